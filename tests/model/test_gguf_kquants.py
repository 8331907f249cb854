"""GGUF files with the K-quant and 5-bit block types (the ``Q4_K_M``-style files most people
download) load to the weights transformers' own GGUF reader dequantizes, and the model built
from them decodes as transformers' model of the same weights does.

``gguf`` can dequantize these types but not quantize them, so the files are written from
random blocks whose float16 scales are set to small finite values (any other bytes are valid
quantized data): every bit of the layout is exercised, and both readers must agree exactly.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from transformers import AutoModelForCausalLM, LlamaConfig

from pagedserve.config import ModelConfig
from pagedserve.model.checkpoint import iterate_weights
from pagedserve.model.loader import load_model
from pagedserve.model.resolve import resolve_model
from tests.model.paged_harness import greedy_generate
from tests.model.test_gguf import finish, gguf_name, gguf_tensor, gguf_writer

KQUANT_TINY = dict(  # rows of 256 and 512 weights: whole K-quant super-blocks
    vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
    max_position_embeddings=256, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)
SCALE_OFFSETS = {
    # byte offsets of each block's float16 scale fields (gguf.quants' block layouts)
    QType.Q2_K: (80, 82),  # scales[16], qs[64], d, dmin
    QType.Q3_K: (108,),  # hmask[32], qs[64], scales[12], d
    QType.Q4_K: (0, 2),  # d, dmin, scales[12], qs[128]
    QType.Q5_K: (0, 2),  # d, dmin, scales[12], qh[32], qs[128]
    QType.Q6_K: (208,),  # ql[128], qh[64], int8 scales[16], d
    QType.Q5_0: (0,),  # d, qh[4], qs[16]
    QType.Q5_1: (0, 2),  # d, m, qh[4], qs[16]
}


def random_blocks(shape: tuple[int, ...], qtype: QType, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row_bytes]: random quantized blocks with scales in [0.5e-3, 2e-3)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, row_len = int(np.prod(shape[:-1])), shape[-1]
    blocks = rng.integers(0, 256, (rows * row_len // block_size, type_size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        scale = rng.uniform(0.5e-3, 2e-3, blocks.shape[0]).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def write_random_gguf(path: Path, config: LlamaConfig, state: dict, qtype: QType) -> None:
    """A llama GGUF file of ``state``'s names and shapes: 2-D tensors random ``qtype`` blocks
    (the token embedding Q6_K, as llama.cpp's mixes often store it), 1-D ones F32 values."""
    rng = np.random.default_rng(0)
    writer = gguf_writer(path, "llama", config)
    for name, tensor in state.items():
        if tensor.dim() == 1:
            value = gguf_tensor("llama", name, tensor.float().numpy(), config)
            writer.add_tensor(gguf_name(name), value, raw_dtype=QType.F32)
            continue
        tensor_type = QType.Q6_K if "embed_tokens" in name else qtype
        data = random_blocks(tuple(tensor.shape), tensor_type, rng)
        writer.add_tensor(gguf_name(name), data, raw_dtype=tensor_type)
    finish(writer)


def _tiny_gguf(tmp_path: Path, qtype: QType) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(**KQUANT_TINY)
    state = AutoModelForCausalLM.from_config(config).state_dict()
    write_random_gguf(tmp_path / "m.gguf", config, state, qtype)
    return tmp_path / "m.gguf"


@pytest.mark.parametrize("qtype", sorted(SCALE_OFFSETS, key=lambda t: t.name))
def test_kquant_weights_equal_transformers_reader(tmp_path: Path, qtype: QType) -> None:
    path = _tiny_gguf(tmp_path, qtype)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).state_dict()
    ours = dict(iterate_weights(resolve_model(str(path))))
    assert set(ours) == set(theirs)
    for name, value in ours.items():
        assert torch.isfinite(value).all(), name
        torch.testing.assert_close(value, theirs[name].float(), rtol=0, atol=0, msg=name)


def test_kquant_model_decodes_like_transformers(tmp_path: Path) -> None:
    """Q4_K layers with a Q6_K embedding: greedy tokens and every position's logits equal
    transformers' model loaded from the same file (its own GGUF reader), in fp32."""
    torch.set_num_threads(1)
    path = _tiny_gguf(tmp_path, QType.Q4_K)
    hf_model = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    ours, config = load_model(ModelConfig(model=str(path), dtype="float32"),
                              torch.device("cpu"), torch.float32)
    prompt = torch.randint(3, config.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf_model.generate(prompt[None], attention_mask=torch.ones(1, 9, dtype=torch.long),
                                 max_new_tokens=12, do_sample=False)[0, 9:].tolist()
    [seq] = greedy_generate(ours, [prompt.tolist()], 12)
    assert seq.generated == want
    # Random blocks make a peaked model (greedy may repeat a token): the logits of every
    # position are the stronger check.
    with torch.no_grad():
        hf_logits = hf_model(torch.tensor([prompt.tolist() + want[:-1]])).logits[0].float()
    assert hf_logits.std(dim=-1).min() > 0.1
    torch.testing.assert_close(torch.stack(seq.logits), hf_logits, atol=1e-3, rtol=1e-4)
