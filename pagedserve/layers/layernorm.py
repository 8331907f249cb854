"""RMSNorm, with the residual add fused in front of it.

A decoder layer keeps the residual stream outside the norm: ``norm(x, residual)`` adds the
sublayer output ``x`` to ``residual`` in fp32, returns the normalized sum and the sum itself
(cast back to the model dtype) as the new residual. Layer 0 has no residual yet and calls
``norm(x)``.

On CUDA the add and the norm run as one Triton kernel (``kernels/rms_norm.py``), behind the
opaque op ``pagedserve::fused_add_rms_norm`` when compiled (Inductor would otherwise split them
into three kernels); on the CPU, eager, a C kernel does both in one pass (``cpu_rows.py``). The
torch code below is the reference and the fallback.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from pagedserve.layers.cpu_rows import add_rms_norm_rows
from pagedserve.layers.linear import copy_shard, new_parameter
from pagedserve.platform import platform_for


class RMSNorm(nn.Module):
    def __init__(
        self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.uses_kernel = platform_for(device).has_triton_kernels()
        self.on_cpu = torch.device(device).type == "cpu"  # the C kernel of layers/cpu_rows.c
        self.weight = new_parameter((hidden_size,), dtype, device, self.weight_loader)
        with torch.no_grad():
            self.weight.fill_(1.0)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: None = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"RMSNorm holds one tensor, got shard_id {shard_id!r}")
        copy_shard(param.data, loaded_weight, 0, 1, 0)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x`` [..., hidden] -> normed, or (normed, x + residual) when a residual is given."""
        if self.on_cpu:
            rows = add_rms_norm_rows(x, residual, self.weight, self.eps)
            if rows is not None:
                return rows[0] if rows[1] is None else (rows[0], rows[1])
        if residual is None:
            return _normalize(x.float(), self.weight, self.eps, x.dtype)
        if self.uses_kernel and kernel_applies(x, residual, self.weight):
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        return add_rms_norm_torch(x, residual, self.weight, self.eps)


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The add + norm in torch ops: the CPU's implementation and the kernel's reference."""
    summed = x.float() + residual.float()  # fp32 [..., hidden]
    return _normalize(summed, weight, eps, x.dtype), summed.to(x.dtype)


def _normalize(
    x32: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(dtype)


def kernel_applies(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    """The Triton kernel's case: rows [T, hidden] of one shape and the weight's dtype (the
    torch code also broadcasts and promotes dtypes; the decoder layers never need either)."""
    return x.dim() == 2 and residual.shape == x.shape and weight.dtype == x.dtype


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, hidden] -> (normed, x + residual): the Triton kernel, as an opaque op
    when traced (eager calls skip the custom-op dispatch, as the attention layer does)."""
    if torch.compiler.is_compiling():
        return torch.ops.pagedserve.fused_add_rms_norm(x, residual, weight, eps)
    return _kernel()(x, residual, weight, eps)


@functools.cache
def _kernel() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """Imported on first use: Triton is only needed (and installed) where CUDA runs."""
    from pagedserve.kernels.rms_norm import fused_add_rms_norm

    return fused_add_rms_norm


@torch.library.custom_op("pagedserve::fused_add_rms_norm", mutates_args=())
def _fused_add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernel()(x, residual, weight, eps)


@_fused_add_rms_norm_op.register_fake
def _fused_add_rms_norm_fake(x, residual, weight, eps):  # noqa: ANN001, ANN202
    return x.new_empty(x.shape), x.new_empty(x.shape)  # contiguous, as the kernel writes them
