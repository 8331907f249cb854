"""GGUF tensor data -> float32 torch tensors, whole tensors at a time.

The same arithmetic as ``gguf.quants`` (so results are bit-identical: fp32 ``d * q`` and, for
Q4_1, a separate ``+ m``), but vectorised over the whole tensor in torch instead of numpy
groups of 16 rows, in place in the output buffer, with no temporaries of the tensor's size
(docs/cpu.md#start-up-on-the-host).

Block layouts (32 weights per block; ``d``, ``m``: float16 scale and minimum):
  Q8_0: d, int8 q[32]                          w = d * q
  Q4_0: d, uint8 qs[16] (low nibbles: 0..15)   w = d * (q - 8)
  Q4_1: d, m, uint8 qs[16]                     w = d * q + m
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from pagedserve.model.gguf_file import GGUFTensor

SUPPORTED_TYPES = frozenset({QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1})
_FLOAT_TYPES = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}


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


def dequantize(tensor: GGUFTensor) -> torch.Tensor:
    """float32 tensor of ``tensor.shape`` (a new tensor, never a view of the file)."""
    if tensor.qtype not in SUPPORTED_TYPES:
        raise ValueError(f"tensor {tensor.name!r}: GGUF type {tensor.qtype.name} is not supported")
    # The memory map is read-only; torch wants writable memory, so take a private copy.
    raw = torch.from_numpy(np.array(tensor.data, copy=True))  # uint8 [num_bytes]
    if tensor.qtype in _FLOAT_TYPES:
        return raw.view(_FLOAT_TYPES[tensor.qtype]).float().reshape(tensor.shape)
    _, type_size = GGML_QUANT_SIZES[tensor.qtype]
    return _dequantize_blocks(raw.view(-1, type_size), tensor.qtype).reshape(tensor.shape)
