"""Weights packed for ``panel_gemm.h``: panels of 16 output columns whose vector loads hold
16 columns at once (bf16: 16 columns x 2 consecutive k, the pairs AVX512-BF16's dot product
takes), so a decode step's products at larger batches need no horizontal sums."""

from __future__ import annotations

import torch
import torch.nn.functional as F

PANEL_COLS = 16


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
