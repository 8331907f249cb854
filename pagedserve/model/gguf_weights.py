"""GGUF tensors as Hugging Face checkpoint tensors: names mapped, data dequantized, q/k rows
un-permuted.

GGUF writes a tensor's shape innermost-first (``ne[0]`` is a row's length), so a
``[out, in]`` torch weight is listed as ``[in, out]``; ``GGUFFile`` already hands us the
torch (outermost-first) shape. Tensors are dequantized one at a time so peak memory stays at
one float32 tensor above the model itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from pagedserve.model.gguf_config import GGUFMetadata
from pagedserve.model.gguf_dequant import SUPPORTED_TYPES, dequantize
from pagedserve.model.resolve import CheckpointError

GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None if unknown."""
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is not None:
        layer, part, kind = match.groups()
        if part not in BLOCK_NAMES:
            return None
        return f"model.layers.{layer}.{BLOCK_NAMES[part]}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    if stem in GLOBAL_NAMES and kind in ("weight", "bias"):
        return f"{GLOBAL_NAMES[stem]}.{kind}"
    return None


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``LlamaModel.permute`` on q/k rows (weight or bias, first dim).

    The converter regroups each head's rows from HF's half-split rotary layout (first half of
    the head: real parts, second half: imaginary parts) into interleaved pairs:
    ``reshape(n_head, 2, d/2, ...).swapaxes(1, 2)``. The inverse swaps the same axes from the
    interleaved view ``(n_head, d/2, 2, ...)``.
    """
    rows_per_half = weight.shape[0] // n_head // 2
    w = weight.reshape(n_head, rows_per_half, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


def check_tensor_types(meta: GGUFMetadata) -> None:
    """Refuse the whole file up front if any tensor has a type we cannot dequantize."""
    for tensor in meta.tensors:
        if tensor.qtype not in SUPPORTED_TYPES:
            supported = ", ".join(t.name for t in sorted(SUPPORTED_TYPES))
            raise CheckpointError(
                f"{meta.path}: tensor {tensor.name!r} ({hf_name(tensor.name)}) has GGUF type "
                f"{tensor.qtype.name}, "
                f"which is not supported (supported: {supported})"
            )


def _heads_for(meta: GGUFMetadata, name: str) -> int | None:
    """Head count whose rows were permuted for this tensor, or None if not permuted."""
    if not meta.arch.permuted_qk:
        return None
    if ".attn_q." in name:
        return int(meta.arch_get("attention.head_count"))
    if ".attn_k." in name:
        heads = int(meta.arch_get("attention.head_count"))
        return int(meta.arch_get("attention.head_count_kv", heads))
    return None


def iterate_gguf_weights(meta: GGUFMetadata) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 CPU tensor) for every tensor of a GGUF file."""
    check_tensor_types(meta)
    for tensor in meta.tensors:
        name = hf_name(tensor.name)
        if name is None:
            raise CheckpointError(
                f"{meta.path}: tensor {tensor.name!r} has no Hugging Face counterpart we know"
            )
        weight = dequantize(tensor)  # float32, its own memory (never a view of the file)
        n_head = _heads_for(meta, tensor.name)
        if n_head is not None:
            weight = unpermute_qk(weight, n_head)
        yield name, weight
