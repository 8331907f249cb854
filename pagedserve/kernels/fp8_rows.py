"""FP8 (e4m3) in Triton kernels: the saturating cast, the per-row scale, and the per-token
quantization of an activation for the FP8 linear layers that read it.

Each is ``layers/quantization/fp8_ops.quantize_rows`` for rows held by one program: the scale
maps the row's largest magnitude to 448 (at least ``MIN_SCALE``), the values are divided by
it, saturated and rounded to nearest even. Divisions are IEEE (``tl.div_rn``): Triton's ``/``
on fp32 compiles to an approximate division on the GPU, and the scales and bytes must be
torch's.

``quantize_rows_fp8`` quantizes an activation that no kernel in front of the linear layer
wrote as FP8 (the attention output read by o_proj). A row of up to ``ONE_PASS_MAX_COLS``
columns is loaded once into registers: its amax, then its quantized values from the same
registers. Wider rows are read twice in blocks, a pass for the amax and one that quantizes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX: tl.constexpr = tl.constexpr(448.0)
"""The largest finite float8_e4m3fn."""
MIN_SCALE: tl.constexpr = tl.constexpr(1.0 / (448.0 * 512.0))
"""The smallest row scale (an all-zero row): ``fp8_ops.MIN_SCALE``."""
ONE_PASS_MAX_COLS = 16384
"""The widest row a program holds whole (Llama-3-8B's 14,336-wide MLP rows fit)."""
LOOP_BLOCK = 4096
"""Columns per step of the two-pass kernel, for rows wider than ``ONE_PASS_MAX_COLS``."""


@triton.jit
def saturate_to_fp8(x):
    """fp32 ``x`` clamped to +-448 and rounded to float8e4nv (an outlier clips, not NaN)."""
    return tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX).to(tl.float8e4nv)


@triton.jit
def row_scale(amax):
    """fp32 scale of a row whose largest magnitude is ``amax``."""
    return tl.maximum(tl.div_rn(amax, FP8_MAX), MIN_SCALE)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,  # [T, K]: rows of stride stride_x, columns contiguous
    out_ptr,  # float8_e4m3fn [T, K] (out)
    scale_ptr,  # fp32 [T] (out): the row scales
    stride_x,
    K,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,  # BLOCK >= K: the row is loaded once
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * K
    if ONE_PASS:
        cols = tl.arange(0, BLOCK)
        mask = cols < K
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(x), axis=0))
        tl.store(scale_ptr + row, scale)
        tl.store(out_row + cols, saturate_to_fp8(tl.div_rn(x, scale)), mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, K, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = row_scale(tl.max(amax, axis=0))
        tl.store(scale_ptr + row, scale)
        for start in range(0, K, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < K
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + cols, saturate_to_fp8(tl.div_rn(x, scale)), mask=mask)


def default_num_warps(block: int) -> int:
    """Warps for a program over ``block`` columns: about 16 values a thread, 4 to 16 warps."""
    return max(4, min(16, block // 512))


def quantize_rows_fp8(
    x: torch.Tensor,  # [T, K] bf16, fp16 or fp32
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (q float8_e4m3fn [T, K], scale fp32 [T, 1]) with q * scale ~ x: the bytes
    and scales of ``fp8_ops.quantize_rows``, in one kernel."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows_fp8: x must be [T, K], got {tuple(x.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    num_tokens, k = x.shape
    out = torch.empty((num_tokens, k), dtype=torch.float8_e4m3fn, device=x.device)  # [T, K]
    scale = torch.empty((num_tokens, 1), dtype=torch.float32, device=x.device)  # [T, 1]
    if num_tokens == 0:
        return out, scale
    one_pass = k <= ONE_PASS_MAX_COLS
    block = triton.next_power_of_2(k) if one_pass else LOOP_BLOCK
    _quantize_rows_kernel[(num_tokens,)](
        x, out, scale, x.stride(0), k, BLOCK=block, ONE_PASS=one_pass,
        num_warps=num_warps or default_num_warps(block),
    )  # fmt: skip
    return out, scale
