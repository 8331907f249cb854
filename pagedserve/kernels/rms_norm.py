"""Residual add + RMSNorm in one pass over each row.

Between two linear layers a decoder layer adds the sublayer output to the residual stream and
normalizes the sum. Inductor emits that as three kernels (the sum of squares, the normalized
product, and the new residual written again), each reading the rows from memory; this kernel
reads ``x`` and ``residual`` once and writes both results: 4 row passes instead of ~8.

Same arithmetic as ``RMSNorm`` (layers/layernorm.py): the sum in fp32, the new residual is the
sum rounded to the model dtype, the norm is taken of the unrounded fp32 sum, rounded, then
multiplied by the weight in the model dtype.

``fused_add_rms_norm_fp8`` writes the normalized rows as FP8 with a scale per row instead (the
input of an FP8 linear layer, ``layers/quantization/fp8_activations.py``): the row, rounded to
the model dtype as above, quantized as ``fp8_ops.quantize_rows`` does, in the same pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.fp8_rows import row_scale, saturate_to_fp8


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr,  # [num_tokens, hidden]
    residual_ptr,  # [num_tokens, hidden]
    weight_ptr,  # [hidden]
    out_ptr,  # [num_tokens, hidden] (out): the normalized sum, or float8_e4m3fn: it / its scale
    scale_ptr,  # fp32 [num_tokens] (out): the row scales of an FP8 out (else unused)
    residual_out_ptr,  # [num_tokens, hidden] (out): the sum
    stride_x,
    stride_residual,
    hidden,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    res = tl.load(residual_ptr + row * stride_residual + offs, mask=mask, other=0.0)
    summed = x + res.to(tl.float32)
    dtype = residual_out_ptr.dtype.element_ty
    tl.store(residual_out_ptr + row * hidden + offs, summed.to(dtype), mask=mask)
    inv_rms = tl.math.rsqrt(tl.sum(summed * summed, axis=0) / hidden + eps)
    normed = (summed * inv_rms).to(dtype)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    if out_ptr.dtype.element_ty == tl.float8e4nv:  # compile-time: the FP8 variant
        out = out.to(dtype).to(tl.float32)  # the model-dtype row an FP8 layer would quantize
        scale = row_scale(tl.max(tl.abs(out), axis=0))
        tl.store(scale_ptr + row, scale)
        out = saturate_to_fp8(tl.div_rn(out, scale))
    tl.store(out_ptr + row * hidden + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x and residual [num_tokens, hidden] with contiguous rows; ValueError for other shapes."""
    if x.dim() != 2 or residual.shape != x.shape or weight.shape != (x.shape[1],):
        raise ValueError(
            f"fused_add_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} must "
            f"be the same [num_tokens, hidden] and weight {tuple(weight.shape)} [hidden]"
        )
    if x.stride(1) != 1 or residual.stride(1) != 1:
        return x.contiguous(), residual.contiguous()
    return x, residual


def _launch_config(hidden: int) -> dict[str, int]:
    block = triton.next_power_of_2(hidden)
    return {"BLOCK": block, "num_warps": max(1, min(16, block // 512))}


def fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(x + residual), x + residual), both [num_tokens, hidden] in x's dtype."""
    x, residual = _rows(x, residual, weight)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return out, residual_out
    _fused_add_rms_norm_kernel[(num_tokens,)](
        x, residual, weight, out, out, residual_out, x.stride(0), residual.stride(0), hidden,
        eps, **_launch_config(hidden),
    )  # fmt: skip
    return out, residual_out


def fused_add_rms_norm_fp8(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [num_tokens, hidden], scale fp32 [num_tokens, 1], x + residual) with
    q * scale ~ weight * rmsnorm(x + residual)."""
    x, residual = _rows(x, residual, weight)
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((num_tokens, 1), dtype=torch.float32, device=x.device)
    residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out, scale, residual_out
    _fused_add_rms_norm_kernel[(num_tokens,)](
        x, residual, weight, out, scale, residual_out, x.stride(0), residual.stride(0), hidden,
        eps, **_launch_config(hidden),
    )  # fmt: skip
    return out, scale, residual_out
