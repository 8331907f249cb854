"""Weights packed for ``panel_gemm.h``: panels of 16 output columns whose vector loads hold
16 columns at once (bf16: 16 columns x 2 consecutive k, the pairs AVX512-BF16's dot product
takes), so a decode step's products at larger batches need no horizontal sums. Where the CPU
has no AVX512-BF16, bf16 weights are packed widened to fp32 panels (twice the bytes), which the
fp32 kernel multiplies (``panel_gemm.h``'s ``PANEL_WIDENS_BF16``)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pagedserve.layers.weight_copies import WeightCopies

PANEL_COLS = 16
PANEL_MIN_ROWS = 3
"""Products of this many rows or more run on panels: from here on they beat the GEMV on the
plain weights, whose time grows with the rows (docs/cpu.md#panel-products)."""
PANEL_MAX_ROWS = 32
"""Products of more rows outside the C decode step go to oneDNN (``cpu_packed_linear.py``),
as fast at 32 rows and faster beyond."""


def panel_pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [n, k] (bf16 with k even, or fp32) -> its panels, a new contiguous tensor: bf16
    [ceil(n/16), k/2, 16, 2], fp32 [ceil(n/16), k, 16]; padding columns are zero.

    Both are a transpose of 32-bit words per panel ([16, words] -> [words, 16]): a bf16 pair
    is one int32. torch copies a transpose of words several times faster than the 4-D permute
    of 2-byte elements, and the zero padding is only copied where n needs it."""
    n, k = weight.shape
    if weight.dtype == torch.bfloat16 and k % 2:
        raise ValueError(f"panel_pack: bf16 weights need an even k, not {k}")
    rows = weight.detach()
    if n % PANEL_COLS:
        rows = F.pad(rows, (0, 0, 0, -n % PANEL_COLS))  # [n16, k]
    words = rows.view(torch.int32) if weight.dtype == torch.bfloat16 else rows  # [n16, w]
    panels = words.view(-1, PANEL_COLS, words.shape[1]).transpose(1, 2)  # [P, w, 16]
    packed = panels.clone(memory_format=torch.contiguous_format)  # never the weight itself
    if weight.dtype == torch.bfloat16:
        return packed.view(torch.bfloat16).view(-1, k // 2, PANEL_COLS, 2)
    return packed


def panel_pack_widened(weight: torch.Tensor) -> torch.Tensor:
    """weight [n, k] -> the fp32 panels of its values (a bf16 weight widened, exactly)."""
    return panel_pack(weight.float())


def panel_packable(weight: torch.Tensor) -> bool:
    """A 2-D fp32 weight, or a bf16 one with an even k."""
    return weight.dim() == 2 and (weight.dtype == torch.float32 or (
        weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0))


@functools.cache
def panel_copies() -> WeightCopies:
    """The process's panel copies, one per weight, shared by the C decode step and the linears
    of other steps (the LM head above all); bf16 weights widened where the built kernels widen
    them."""
    from pagedserve.layers.cpu_gemv import panels_widen_bf16  # it imports this module

    if panels_widen_bf16():
        return WeightCopies(panel_pack_widened, "linear's panels (widened to fp32)",
                            copy_dtype=torch.float32)
    return WeightCopies(panel_pack, "linear's panels")
