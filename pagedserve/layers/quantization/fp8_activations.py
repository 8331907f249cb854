"""The layers in front of FP8 linear layers that quantize their activations per token: the
RMSNorm (with its fused residual add) and the SiLU-and-mul of the MLP write FP8 plus a scale
per token (``Fp8Activation``) in their own kernel, so the FP8 GEMM needs no quantization pass
(``fp8_ops.scaled_mm_linear``).

A model takes these classes where its linear layers quantize activations per token on FP8
tensor cores (``input_layers``: ``InputLayers`` of the linear method), the plain ones
elsewhere. On CUDA the Triton kernels run (``kernels/rms_norm.py``,
``kernels/silu_and_mul.py``), behind opaque ops when compiled; the torch code (the plain
layer's, then ``quantize_rows``) is the reference and runs elsewhere. The first layer's
input norm has no residual to add: the plain norm, then a quantization pass (eagerly on
CUDA the Triton one, ``kernels/fp8_rows.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedserve.layers.activation import SiluAndMul, silu_and_mul_torch
from pagedserve.layers.layernorm import RMSNorm, add_rms_norm_torch, kernel_applies
from pagedserve.layers.quantization.fp8_ops import (
    Fp8Activation,
    fp8_kernels,
    quantize_per_token,
    quantize_rows,
)


class InputLayers(NamedTuple):
    """The classes of the layers whose outputs a model's linear layers read."""

    norm: type[RMSNorm]
    activation: type[SiluAndMul]


def _quantized(t: torch.Tensor) -> Fp8Activation:
    """t [..., K] quantized per token by a pass of its own: the torch code when compiled
    (Inductor fuses it with the torch norm or activation that made ``t``), eagerly the Triton
    kernel on CUDA (``fp8_ops.quantize_per_token``)."""
    rows = t.reshape(-1, t.shape[-1])  # [T, K]
    if torch.compiler.is_compiling():
        q, scale = quantize_rows(rows)  # float8 [T, K], fp32 [T]
        return Fp8Activation(q, scale.unsqueeze(-1), t.dtype)
    return Fp8Activation(*quantize_per_token(rows), t.dtype)


class Fp8RMSNorm(RMSNorm):
    """RMSNorm whose normalized output is an ``Fp8Activation``; the residual stays in the
    model dtype."""

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> Fp8Activation | tuple[Fp8Activation, torch.Tensor]:
        if residual is None:  # the first layer's input norm: torch, then a quantization pass
            return _quantized(super().forward(x))  # type: ignore[arg-type]
        if self.uses_kernel and kernel_applies(x, residual, self.weight):
            if torch.compiler.is_compiling():
                q, scale, summed = torch.ops.pagedserve.fused_add_rms_norm_fp8(
                    x, residual, self.weight, self.eps)
            else:
                q, scale, summed = fp8_kernels().fused_add_rms_norm(
                    x, residual, self.weight, self.eps)
            return Fp8Activation(q, scale, x.dtype), summed
        normed, summed = add_rms_norm_torch(x, residual, self.weight, self.eps)
        return _quantized(normed), summed


class Fp8SiluAndMul(SiluAndMul):
    """SiLU-and-mul whose output is an ``Fp8Activation``."""

    def forward(self, x: torch.Tensor) -> Fp8Activation:  # type: ignore[override]
        if self.uses_kernel and x.dim() == 2:
            if torch.compiler.is_compiling():
                q, scale = torch.ops.pagedserve.silu_and_mul_fp8(x)
            else:
                q, scale = fp8_kernels().silu_and_mul(x)
            return Fp8Activation(q, scale, x.dtype)
        return _quantized(silu_and_mul_torch(x))


PLAIN_INPUT_LAYERS = InputLayers(RMSNorm, SiluAndMul)
FP8_INPUT_LAYERS = InputLayers(Fp8RMSNorm, Fp8SiluAndMul)
"""Where the linear layers quantize their activations per token on FP8 tensor cores."""


@torch.library.custom_op("pagedserve::fused_add_rms_norm_fp8", mutates_args=())
def _fused_add_rms_norm_fp8_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return fp8_kernels().fused_add_rms_norm(x, residual, weight, eps)


@_fused_add_rms_norm_fp8_op.register_fake
def _fused_add_rms_norm_fp8_fake(x, residual, weight, eps):  # noqa: ANN001, ANN202
    return (x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            x.new_empty((x.shape[0], 1), dtype=torch.float32), x.new_empty(x.shape))


@torch.library.custom_op("pagedserve::silu_and_mul_fp8", mutates_args=())
def _silu_and_mul_fp8_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8_kernels().silu_and_mul(x)


@_silu_and_mul_fp8_op.register_fake
def _silu_and_mul_fp8_fake(x):  # noqa: ANN001, ANN202
    d = x.shape[1] // 2
    return (x.new_empty((x.shape[0], d), dtype=torch.float8_e4m3fn),
            x.new_empty((x.shape[0], 1), dtype=torch.float32))

