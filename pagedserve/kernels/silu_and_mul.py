"""The MLP's gated activation, ``silu(gate) * up``, in one pass over the gate_up output.

Same rounding as the torch code in ``layers/activation.py`` run eagerly in the model dtype:
``silu`` computed in fp32 and rounded, the product computed in fp32 and rounded.

``silu_and_mul_fp8`` writes the product as FP8 with a scale per row instead (the input of an
FP8 down_proj, ``layers/quantization/fp8_activations.py``), quantized as
``fp8_ops.quantize_rows`` does, one program per row. A row of up to ``ONE_PASS_MAX_COLS``
products (Llama-3-8B's 14,336) is computed once and held in registers: its amax, then its
quantized values. Wider rows go to ``silu_and_mul_fp8_two_pass``: a first pass over the row
in blocks for its largest magnitude, a second that computes the products again, quantizes
and stores (its reads hit the cache).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.fp8_rows import (
    ONE_PASS_MAX_COLS,
    default_num_warps,
    row_scale,
    saturate_to_fp8,
)

# Columns per program and warps of ``silu_and_mul`` and the two-pass FP8 kernel: the best of
# 1,024-4,096 columns x 4-8 warps on the H200 at 64, 256 and 8,192 rows of Llama-3-8B's 14,336
# (docs/performance.md#fusions).
BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _gated(x_row_ptr, cols, mask, d, dtype: tl.constexpr):
    """silu(gate) * up of the columns ``cols`` of one row, rounded to ``dtype``, in fp32."""
    gate = tl.load(x_row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row_ptr + d + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(dtype).to(tl.float32)


@triton.jit
def _silu_and_mul_fp8_row_kernel(
    x_ptr,  # [num_tokens, 2 * d]: gate | up
    out_ptr,  # float8_e4m3fn [num_tokens, d] (out)
    scale_ptr,  # fp32 [num_tokens] (out): the row scales
    stride_x,
    d,
    BLOCK: tl.constexpr,  # >= d: the whole row
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    gated = _gated(x_ptr + row * stride_x, cols, mask, d, x_ptr.dtype.element_ty)  # fp32 [BLOCK]
    scale = row_scale(tl.max(tl.abs(gated), axis=0))
    tl.store(scale_ptr + row, scale)
    tl.store(out_ptr + row * d + cols, saturate_to_fp8(tl.div_rn(gated, scale)), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr,  # [num_tokens, 2 * d]: gate | up
    out_ptr,  # float8_e4m3fn [num_tokens, d] (out)
    scale_ptr,  # fp32 [num_tokens] (out): the row scales
    stride_x,
    d,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    dtype = x_ptr.dtype.element_ty
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, d, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(_gated(x_row, cols, cols < d, d, dtype)))
    scale = row_scale(tl.max(amax, axis=0))
    tl.store(scale_ptr + row, scale)
    for start in range(0, d, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < d
        q = saturate_to_fp8(tl.div_rn(_gated(x_row, cols, mask, d, dtype), scale))
        tl.store(out_ptr + row * d + cols, q, mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [num_tokens, 2 * d]: gate | up
    out_ptr,  # [num_tokens, d]
    stride_x,
    stride_out,
    d,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _gate_up(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(x with contiguous rows, num_tokens, d) of x [num_tokens, 2 * d]; ValueError else."""
    if x.dim() != 2 or x.shape[1] % 2 != 0:
        raise ValueError(f"silu_and_mul: x must be [num_tokens, 2 * d], got {tuple(x.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    return x, x.shape[0], x.shape[1] // 2


def silu_and_mul(
    x: torch.Tensor,  # [num_tokens, 2 * d]
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """[num_tokens, 2 * d] = [gate | up] -> silu(gate) * up, [num_tokens, d] in x's dtype."""
    x, num_tokens, d = _gate_up(x)
    out = torch.empty((num_tokens, d), dtype=x.dtype, device=x.device)  # [num_tokens, d]
    if num_tokens == 0:
        return out
    grid = (num_tokens, triton.cdiv(d, block))
    _silu_and_mul_kernel[grid](
        x, out, x.stride(0), out.stride(0), d, BLOCK=block, num_warps=num_warps
    )
    return out


def silu_and_mul_fp8(
    x: torch.Tensor,  # [num_tokens, 2 * d]
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_tokens, 2 * d] = [gate | up] -> (q float8_e4m3fn [num_tokens, d], scale fp32
    [num_tokens, 1]) with q * scale ~ silu(gate) * up in x's dtype. One pass over each row
    where it fits in a program's registers, else ``silu_and_mul_fp8_two_pass``."""
    x, num_tokens, d = _gate_up(x)
    if d > ONE_PASS_MAX_COLS:
        return silu_and_mul_fp8_two_pass(x, num_warps=num_warps or NUM_WARPS)
    out, scale = _fp8_outputs(x, num_tokens, d)  # float8 [num_tokens, d], fp32 [num_tokens, 1]
    if num_tokens > 0:
        block = triton.next_power_of_2(d)
        warps = num_warps or default_num_warps(block)  # 16 for Llama-3-8B's 16,384 block
        _silu_and_mul_fp8_row_kernel[(num_tokens,)](
            x, out, scale, x.stride(0), d, BLOCK=block, num_warps=warps
        )
    return out, scale


def silu_and_mul_fp8_two_pass(
    x: torch.Tensor,  # [num_tokens, 2 * d]
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu_and_mul_fp8`` for rows of any width, in blocks of ``block`` columns: the amax
    over the row first, then the products again, quantized."""
    x, num_tokens, d = _gate_up(x)
    out, scale = _fp8_outputs(x, num_tokens, d)  # float8 [num_tokens, d], fp32 [num_tokens, 1]
    if num_tokens > 0:
        _silu_and_mul_fp8_kernel[(num_tokens,)](
            x, out, scale, x.stride(0), d, BLOCK=block, num_warps=num_warps
        )
    return out, scale


def _fp8_outputs(x: torch.Tensor, num_tokens: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (q float8_e4m3fn [num_tokens, d], scale fp32 [num_tokens, 1]) on x's device."""
    out = torch.empty((num_tokens, d), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((num_tokens, 1), dtype=torch.float32, device=x.device)
    return out, scale
