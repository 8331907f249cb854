"""Gated activation of the MLP.

On CUDA the split, SiLU and product run as one Triton kernel (``kernels/silu_and_mul.py``),
behind the opaque op ``pagedserve::silu_and_mul`` when compiled; it is faster than Inductor's
kernel of the same torch code (docs/gpu.md, "Fused kernels"). On the CPU, eager, a C kernel
does the same in one pass (``cpu_rows.py``); the torch code below is the reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.cpu_rows import silu_and_mul_rows
from pagedserve.platform import platform_for


class SiluAndMul(nn.Module):
    """``x`` [..., 2 * d] = [gate | up] -> silu(gate) * up [..., d], on ``device``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.uses_kernel = platform_for(device).has_triton_kernels()
        self.on_cpu = torch.device(device).type == "cpu"  # the C kernel of layers/cpu_rows.c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_kernel and x.dim() == 2:
            if torch.compiler.is_compiling():
                return torch.ops.pagedserve.silu_and_mul(x)
            return _kernel()(x)
        if self.on_cpu:
            out = silu_and_mul_rows(x)
            if out is not None:
                return out
        return silu_and_mul_torch(x)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


@functools.cache
def _kernel() -> Callable[[torch.Tensor], torch.Tensor]:
    """Imported on first use: Triton is only needed (and installed) where CUDA runs."""
    from pagedserve.kernels.silu_and_mul import silu_and_mul

    return silu_and_mul


@torch.library.custom_op("pagedserve::silu_and_mul", mutates_args=())
def _silu_and_mul_op(x: torch.Tensor) -> torch.Tensor:
    return _kernel()(x)


@_silu_and_mul_op.register_fake
def _silu_and_mul_fake(x):  # noqa: ANN001, ANN202
    return x.new_empty((x.shape[0], x.shape[1] // 2))
