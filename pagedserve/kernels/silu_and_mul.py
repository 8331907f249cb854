"""The MLP's gated activation, ``silu(gate) * up``, in one pass over the gate_up output.

Same rounding as the torch code in ``layers/activation.py`` run eagerly in the model dtype:
``silu`` computed in fp32 and rounded, the product computed in fp32 and rounded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns per program and warps: the best of 1,024-4,096 columns x 4-8 warps on the H200 at
# 64, 256 and 8,192 rows of Llama-3-8B's 14,336 (docs/performance.md#fusions).
BLOCK = 2048
NUM_WARPS = 8


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


def silu_and_mul(
    x: torch.Tensor,  # [num_tokens, 2 * d]
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """[num_tokens, 2 * d] = [gate | up] -> silu(gate) * up, [num_tokens, d] in x's dtype."""
    if x.dim() != 2 or x.shape[1] % 2 != 0:
        raise ValueError(f"silu_and_mul: x must be [num_tokens, 2 * d], got {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    num_tokens, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, d), dtype=x.dtype, device=x.device)  # [num_tokens, d]
    if num_tokens == 0:
        return out
    grid = (num_tokens, triton.cdiv(d, block))
    _silu_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), d, BLOCK=block, num_warps=num_warps)
    return out
