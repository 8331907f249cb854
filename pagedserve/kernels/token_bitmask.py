"""Triton kernel: apply a packed token bitmask to some rows of the logits, in place (the
CUDA side of ``structured_output.bitmask.apply_token_bitmask``, same semantics)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.sampling_common import NEG_INF

_BLOCK = 1024


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,  # [num_rows, V]
    logits_stride,
    bitmask_ptr,  # int32 [R, W]
    bitmask_stride,
    rows_ptr,  # int64 [R]
    vocab_size,
    BLOCK: tl.constexpr,
):
    k = tl.program_id(0)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offsets < vocab_size
    words = tl.load(bitmask_ptr + k * bitmask_stride + offsets // 32, mask=in_vocab, other=0)
    allowed = ((words >> (offsets % 32)) & 1) != 0
    row = tl.load(rows_ptr + k)
    tl.store(logits_ptr + row * logits_stride + offsets, NEG_INF,
             mask=in_vocab & ~allowed)


def apply_token_bitmask_triton(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> None:
    """logits [num_rows, V] (last dim contiguous), bitmask int32 [R, cdiv(V, 32)], rows int64
    [R], all on one device; masks ``logits`` in place. One program per (row, vocab block)."""
    vocab_size = logits.shape[1]
    if rows.shape[0] == 0:
        return
    grid = (rows.shape[0], triton.cdiv(vocab_size, _BLOCK))
    _apply_token_bitmask_kernel[grid](
        logits, logits.stride(0), bitmask, bitmask.stride(0), rows, vocab_size, BLOCK=_BLOCK)
