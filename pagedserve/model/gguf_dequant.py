"""GGUF tensor data -> float32 torch tensors, whole tensors at a time.

Two ways, one result (bit-identical to ``gguf.quants``):
- Q8_0, Q4_0, Q4_1 (the default model's types): the same arithmetic as ``gguf.quants``
  (fp32 ``d * q`` and, for Q4_1, a separate ``+ m``), vectorised over the whole tensor in
  torch, in place in the output buffer, with no temporaries of the tensor's size
  (docs/cpu.md#start-up-on-the-host).
- Every other quantized type we accept (Q5_0, Q5_1 and the K-quants Q2_K..Q6_K, the types of
  the ``Q4_K_M``-style files most people download): ``gguf.quants.dequantize`` itself, a
  bounded number of rows at a time so peak memory stays near one float32 tensor.
  docs/cpu.md#gguf-files says what each costs at load.

Block layouts of the torch path (32 weights per block; ``d``, ``m``: float16 scale, minimum):
  Q8_0: d, int8 q[32]                          w = d * q
  Q4_0: d, uint8 qs[16] (low nibbles: 0..15)   w = d * (q - 8)
  Q4_1: d, m, uint8 qs[16]                     w = d * q + m
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as QType

from pagedserve.model.gguf_file import GGUFTensor

_TORCH_TYPES = frozenset({QType.Q8_0, QType.Q4_0, QType.Q4_1})
_GGUF_TYPES = frozenset(
    {QType.Q5_0, QType.Q5_1, QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K}
)
"""Dequantized by ``gguf.quants`` (its numpy code covers them; Q8_1 it does not)."""
_FLOAT_TYPES = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}
SUPPORTED_TYPES = frozenset(_FLOAT_TYPES) | _TORCH_TYPES | _GGUF_TYPES
GGUF_CHUNK_ELEMENTS = 1 << 22
"""Weights per ``gguf.quants`` call: bounds its float32 temporaries (a few of this size)."""


def _scales(blocks: torch.Tensor, count: int) -> torch.Tensor:
    """float32 [n, count]: the ``count`` float16 values at the start of every block."""
    return blocks[:, : 2 * count].contiguous().view(torch.float16).float()


def _unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 16] packed pairs -> float32 [n, 32]: low nibbles first, then high ones.
    Written into one output buffer (no concatenated uint8 copy, no second float copy)."""
    out = torch.empty(qs.shape[0], 2, 16)  # float32 [n, 2, 16]
    out[:, 0].copy_(qs & 0x0F)
    out[:, 1].copy_(qs >> 4)
    return out.view(-1, 32)


def _dequantize_blocks(blocks: torch.Tensor, qtype: QType) -> torch.Tensor:
    """uint8 [num_blocks, type_size] -> float32 [num_blocks, 32], computed in place in the
    output buffer with ``gguf.quants``' operation order (so bit-identical)."""
    if qtype == QType.Q8_0:
        out = torch.empty(blocks.shape[0], 32)  # float32 [n, 32]
        out.copy_(blocks[:, 2:].view(torch.int8))
        return out.mul_(_scales(blocks, 1))
    if qtype == QType.Q4_0:
        return _unpack_nibbles(blocks[:, 2:]).sub_(8.0).mul_(_scales(blocks, 1))
    d_m = _scales(blocks, 2)  # Q4_1: float32 [n, 2], scale then minimum
    return _unpack_nibbles(blocks[:, 4:]).mul_(d_m[:, :1]).add_(d_m[:, 1:])


def _dequantize_with_gguf(data: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> torch.Tensor:
    """``gguf.quants.dequantize`` over whole rows, a chunk of rows at a time, written into one
    float32 output tensor of ``shape``."""
    row_len = shape[-1]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows = data.reshape(-1, row_len // block_size * type_size)  # uint8 [num_rows, row_bytes]
    out = torch.empty(rows.shape[0], row_len)  # float32 [num_rows, row_len]
    step = max(1, GGUF_CHUNK_ELEMENTS // row_len)
    for start in range(0, rows.shape[0], step):
        chunk = quants.dequantize(rows[start : start + step], qtype)
        out[start : start + step].copy_(torch.from_numpy(chunk))
    return out.reshape(shape)


def dequantize(tensor: GGUFTensor) -> torch.Tensor:
    """float32 tensor of ``tensor.shape`` (a new tensor, never a view of the file)."""
    if tensor.qtype not in SUPPORTED_TYPES:
        raise ValueError(f"tensor {tensor.name!r}: GGUF type {tensor.qtype.name} is not supported")
    if tensor.qtype in _GGUF_TYPES:
        return _dequantize_with_gguf(tensor.data, tensor.qtype, tensor.shape)
    # The memory map is read-only; torch wants writable memory, so take a private copy.
    raw = torch.from_numpy(np.array(tensor.data, copy=True))  # uint8 [num_bytes]
    if tensor.qtype in _FLOAT_TYPES:
        return raw.view(_FLOAT_TYPES[tensor.qtype]).float().reshape(tensor.shape)
    _, type_size = GGML_QUANT_SIZES[tensor.qtype]
    return _dequantize_blocks(raw.view(-1, type_size), tensor.qtype).reshape(tensor.shape)
