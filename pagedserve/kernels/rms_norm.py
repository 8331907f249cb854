"""Residual add + RMSNorm in one pass over each row.

Between two linear layers a decoder layer adds the sublayer output to the residual stream and
normalizes the sum. Inductor emits that as three kernels (the sum of squares, the normalized
product, and the new residual written again), each reading the rows from memory; this kernel
reads ``x`` and ``residual`` once and writes both results: 4 row passes instead of ~8.

Same arithmetic as ``RMSNorm`` (layers/layernorm.py): the sum in fp32, the new residual is the
sum rounded to the model dtype, the norm is taken of the unrounded fp32 sum, rounded, then
multiplied by the weight in the model dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr,  # [num_tokens, hidden]
    residual_ptr,  # [num_tokens, hidden]
    weight_ptr,  # [hidden]
    out_ptr,  # [num_tokens, hidden] (out): the normalized sum
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
    tl.store(
        residual_out_ptr + row * hidden + offs,
        summed.to(residual_out_ptr.dtype.element_ty),
        mask=mask,
    )
    inv_rms = tl.math.rsqrt(tl.sum(summed * summed, axis=0) / hidden + eps)
    normed = (summed * inv_rms).to(out_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * hidden + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(x + residual), x + residual), both [num_tokens, hidden] in x's dtype."""
    if x.dim() != 2 or residual.shape != x.shape or weight.shape != (x.shape[1],):
        raise ValueError(
            f"fused_add_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} must "
            f"be the same [num_tokens, hidden] and weight {tuple(weight.shape)} [hidden]"
        )
    if x.stride(1) != 1 or residual.stride(1) != 1:
        x, residual = x.contiguous(), residual.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return out, residual_out
    block = triton.next_power_of_2(hidden)
    _fused_add_rms_norm_kernel[(num_tokens,)](
        x, residual, weight, out, residual_out, x.stride(0), residual.stride(0), hidden, eps,
        BLOCK=block, num_warps=max(1, min(16, block // 512)),
    )  # fmt: skip
    return out, residual_out
