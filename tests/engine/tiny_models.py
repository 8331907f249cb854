"""Tiny random checkpoints with a real (tiny, byte-level BPE) tokenizer, for engine tests.

The tokenizer is trained in a second on a small corpus, so multi-byte characters (accents,
CJK, emoji) are split over several tokens, as with real byte-level BPE vocabularies. The
model's vocabulary is exactly the tokenizer's, so every sampled id decodes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 384
MAX_POSITIONS = 512
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello world! This is a tiny tokenizer for tests, nothing more.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "naïve café résumé 日本語 テスト 🎉 emoji ✓ Zürich",
]

ARCHS = ("llama", "qwen3")


def make_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_model(arch: str, vocab_size: int, eos_token_id: int) -> PreTrainedModel:
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=0.1,  # wide logits: no near-ties for greedy decoding to trip on
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=None,
    )
    if arch == "llama":
        model_cls, config = LlamaForCausalLM, LlamaConfig(**common)
    elif arch == "qwen3":
        model_cls, config = Qwen3ForCausalLM, Qwen3Config(**common, head_dim=16)
    else:
        raise ValueError(f"arch: unknown tiny architecture {arch!r}")
    config.architectures = [model_cls.__name__]
    torch.manual_seed(0)
    return model_cls(config).eval()


def save_checkpoint(
    arch: str, folder: Path
) -> tuple[Path, PreTrainedModel, PreTrainedTokenizerFast]:
    """A Hugging Face folder (config, safetensors, tokenizer) of a tiny random ``arch`` model."""
    tokenizer = make_tokenizer()
    model = make_model(arch, len(tokenizer), tokenizer.eos_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model, tokenizer


def hf_greedy(model: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Transformers' greedy continuation of one prompt with EOS disabled (our side uses
    ``ignore_eos``). EOS is unset rather than suppressed (``min_new_tokens`` would mask it
    out of the argmax, which ``ignore_eos`` does not)."""
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    saved_eos, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt_ids]),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                generation_config=config,
            )
    finally:
        model.generation_config.eos_token_id = saved_eos
    return out[0, len(prompt_ids) :].tolist()


def hf_log_softmax(model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """fp32 [len(token_ids), vocab]: row i is log p(next token | token_ids[: i + 1])."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def hf_beam_search(model: PreTrainedModel, prompt_ids: list[int], width: int, max_tokens: int,
                   eos_ids: frozenset[int] = frozenset(), length_penalty: float = 1.0,
                   ) -> list[tuple[list[int], float]]:
    """A plain beam search over transformers' log-probabilities, by the rules of
    pagedserve/beam_search.py: every live beam's 2 x width most likely next tokens are the
    candidates, the width best non-EOS ones stay live, an EOS one is complete; score = summed
    log-probability / (tokens, a final EOS not counted) ** length_penalty. Returns the width
    best (generated tokens, summed log-probability), best first."""

    def score(beam: tuple[list[int], float]) -> float:
        tokens, total = beam
        ended = bool(tokens) and tokens[-1] in eos_ids
        return total / max(1, len(tokens) - ended) ** length_penalty

    live: list[tuple[list[int], float]] = [([], 0.0)]
    complete: list[tuple[list[int], float]] = []
    for _ in range(max_tokens):
        extended = []
        for tokens, total in live:
            top = torch.topk(hf_log_softmax(model, prompt_ids + tokens)[-1], 2 * width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                child = (tokens + [token], total + logprob)
                (complete if token in eos_ids else extended).append(child)
        live = sorted(extended, key=score, reverse=True)[:width]
        if not live:
            break
    return sorted(complete + live, key=score, reverse=True)[:width]
