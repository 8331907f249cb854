"""Weights packed for ``panel_gemm.h``: panels of 16 output columns whose vector loads hold
16 columns at once (bf16: 16 columns x 2 consecutive k, the pairs AVX512-BF16's dot product
takes), so a decode step's products at larger batches need no horizontal sums."""

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
    """weight [n, k] (bf16 with k even, or fp32) -> its panels, contiguous: bf16
    [ceil(n/16), k/2, 16, 2], fp32 [ceil(n/16), k, 16]; padding columns are zero."""
    n, k = weight.shape
    if weight.dtype == torch.bfloat16 and k % 2:
        raise ValueError(f"panel_pack: bf16 weights need an even k, not {k}")
    padded = F.pad(weight.detach(), (0, 0, 0, -n % PANEL_COLS))  # [n16, k]
    panels = padded.view(-1, PANEL_COLS, k)  # [P, 16, k]
    if weight.dtype == torch.bfloat16:
        return panels.view(-1, PANEL_COLS, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return panels.permute(0, 2, 1).contiguous()


def panel_packable(weight: torch.Tensor) -> bool:
    """A 2-D fp32 weight, or a bf16 one with an even k."""
    return weight.dim() == 2 and (weight.dtype == torch.float32 or (
        weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0))


@functools.cache
def panel_copies() -> WeightCopies:
    """The process's panel copies, one per weight, shared by the C decode step and the linears
    of other steps (the LM head above all)."""
    return WeightCopies(panel_pack, "linear's panels")
