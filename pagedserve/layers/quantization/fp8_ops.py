"""FP8 (e4m3) arithmetic: row-wise quantization and the two ways an FP8 linear computes.

``scaled_mm_linear`` runs on FP8 tensor cores with row-wise scaling (one scale per token of
the activation, one per output channel of the weight): ``torch._scaled_mm``, or from a few
hundred tokens up on Hopper the persistent TMA kernel of ``kernels/fp8_gemm.py``
(``PERSISTENT_MIN_ROWS``).
``dequantized_linear`` is the reference and the CPU path: the weight dequantized into the
compute dtype, then an ordinary matmul (the activation stays unquantized).

The activation is quantized per token here by a separate pass over it, unless it comes
quantized already (``Fp8Activation``): the RMSNorm and SiLU-and-mul layers in front of FP8
layers write FP8 plus the per-token scale in their own kernel
(``layers/quantization/fp8_activations.py``). That pass (o_proj's input, the attention
output) is one Triton kernel on CUDA (``kernels/fp8_rows.quantize_rows_fp8``: one read of
the rows, the FP8 bytes and scales written); ``quantize_rows`` is its torch reference and
the pass elsewhere.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from pagedserve.platform import platform_for
from pagedserve.platform.base import triton_available

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
"""The smallest scale: an all-zero row gets it (no division by zero)."""


class Fp8Activation(NamedTuple):
    """An activation quantized per token by the layer that produced it."""

    data: torch.Tensor  # float8_e4m3fn [T, K]
    scale: torch.Tensor  # fp32 [T, 1]: data * scale ~ the activation
    dtype: torch.dtype
    """The model dtype: the activation's before quantization, the consumer's output."""

    def dequantize(self) -> torch.Tensor:
        """[T, K] in ``dtype``."""
        return (self.data.float() * self.scale).to(self.dtype)


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [R, C] -> (q float8_e4m3fn [R, C], scale fp32 [R]) with t ~ q * scale[:, None]: each
    row's largest magnitude maps to the largest FP8 value."""
    t32 = t.float()
    scale = (t32.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)  # [R]
    q = (t32 / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float8_e4m3fn [M, K], scale fp32 [M, 1]): ``quantize_rows``'s bytes and
    scales, by the Triton kernel where it runs (one pass instead of a handful of torch ops).
    Eager code only (inside an opaque op): a compiled graph would trace the kernel launch."""
    kernel = _row_kernel_for(x)
    if kernel is not None:
        return kernel(x)
    q, scale = quantize_rows(x)  # float8 [M, K], fp32 [M]
    return q, scale.unsqueeze(-1)


class Fp8Kernels(NamedTuple):
    """The Triton kernels that write activations as FP8 with a scale per token."""

    quantize_rows: Any  # kernels/fp8_rows.quantize_rows_fp8
    fused_add_rms_norm: Any  # kernels/rms_norm.fused_add_rms_norm_fp8
    silu_and_mul: Any  # kernels/silu_and_mul.silu_and_mul_fp8


@functools.cache
def fp8_kernels() -> Fp8Kernels:
    """Imported on first use: Triton is only needed (and installed) where CUDA runs."""
    from pagedserve.kernels.fp8_rows import quantize_rows_fp8
    from pagedserve.kernels.rms_norm import fused_add_rms_norm_fp8
    from pagedserve.kernels.silu_and_mul import silu_and_mul_fp8

    return Fp8Kernels(quantize_rows_fp8, fused_add_rms_norm_fp8, silu_and_mul_fp8)


def _row_kernel_for(
    x: torch.Tensor,
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
    """The Triton quantization kernel for x's device: CUDA with Triton installed, else None."""
    return fp8_kernels().quantize_rows if x.is_cuda and triton_available() else None


PERSISTENT_MIN_ROWS = 384
"""Products of at least this many tokens (prefill steps, decode steps of large batches) run
``kernels/fp8_gemm.py``'s persistent TMA kernel where the card has TMA; smaller ones, and
cards without it, run ``torch._scaled_mm``. From this size up the kernel was as fast or faster
on Llama-3-8B's linear shapes, within a few percent where slower; below it, slower on all
four (docs/gpu.md#fp8-gemms)."""


def rows_product(xq: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The row-wise FP8 product for xq's token count and device (``PERSISTENT_MIN_ROWS``)."""
    if xq.shape[0] >= PERSISTENT_MIN_ROWS and _has_tma(xq.device):
        return _persistent_product
    return scaled_mm


@functools.cache
def _has_tma(device: torch.device) -> bool:
    """A card with the tensor memory accelerator (compute capability 9.0 or newer) and the
    Triton kernels to drive it."""
    platform = platform_for(device)
    return platform.has_triton_kernels() and platform.compute_capability() >= (9, 0)


def _persistent_product(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """``scaled_mm`` on the persistent TMA kernel: bf16 [M, N]."""
    from pagedserve.kernels.fp8_gemm import fp8_gemm_persistent

    return fp8_gemm_persistent(xq, x_scale, weight, weight_scale.view(-1, 1))


def quantize_static(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """t [R, C] with one given scale (fp32 [1]) -> float8_e4m3fn [R, C]."""
    return (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q float8 [R, C], scale fp32 [R] -> fp32 [R, C]."""
    return q.float() * scale.unsqueeze(-1)


def dequantized_linear(
    x: torch.Tensor | Fp8Activation, weight: torch.Tensor, weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x [..., K] @ (weight float8 [N, K] * weight_scale [N, 1])^T + bias, in x's dtype (an
    ``Fp8Activation`` is dequantized first)."""
    if isinstance(x, Fp8Activation):
        x = x.dequantize()
    return F.linear(x, dequantize_rows(weight, weight_scale).to(x.dtype), bias)


def scaled_mm_linear(
    x: torch.Tensor | Fp8Activation, weight: torch.Tensor, weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None, bias: torch.Tensor | None,
) -> torch.Tensor:
    """x [..., K] -> [..., N] on FP8 tensor cores (CUDA, compute capability >= 8.9).

    ``input_scale`` fp32 [1]: the checkpoint's static activation scale; None: a scale per
    token, computed here. Row-wise ``_scaled_mm`` wants K and N multiples of 16, scales of
    shape [M, 1] and [1, N] and a bf16 output; other compute dtypes are cast back.

    Runs as the opaque op ``pagedserve::fp8_linear`` (``_fp8_linear_op``): inside a compiled
    piece the token count is an unbacked size, on which ``_scaled_mm``'s shape checks would
    have to guard. An ``Fp8Activation`` goes in as it is (``pagedserve::fp8_linear_rows``)."""
    if isinstance(x, Fp8Activation):
        return _fp8_linear_rows_op(x.data, x.scale, weight, weight_scale, bias, x.dtype)
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    out = _fp8_linear_op(x2, weight, weight_scale, input_scale, bias)  # [M, N]
    return out.reshape(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("pagedserve::fp8_linear", mutates_args=())
def _fp8_linear_op(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None, bias: torch.Tensor | None,
) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype."""
    if input_scale is None:
        xq, x_scale = quantize_per_token(x)  # float8 [M, K], fp32 [M, 1]
    else:
        xq = quantize_static(x, input_scale)
        x_scale = input_scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()  # [M, 1]
    return _scaled_mm_rows(xq, x_scale, weight, weight_scale, bias, x.dtype)


def _scaled_mm_rows(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:
    """xq float8 [M, K] with x_scale fp32 [M, 1] -> [M, N] in ``out_dtype``."""
    out = rows_product(xq)(xq, x_scale, weight, weight_scale).to(out_dtype)  # [M, N]
    if bias is not None:
        out = out + bias
    return out


def scaled_mm(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """``torch._scaled_mm`` of xq float8 [M, K] and weight float8 [N, K] -> bf16 [M, N].
    Row-wise with x_scale fp32 [M, 1] and weight_scale fp32 [N, 1] (or [N]); per tensor when
    both hold one element."""
    return torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
                            out_dtype=torch.bfloat16)


@_fp8_linear_op.register_fake
def _fp8_linear_fake(x, weight, weight_scale, input_scale, bias):  # noqa: ANN001, ANN202
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("pagedserve::fp8_linear_rows", mutates_args=())
def _fp8_linear_rows_op(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:
    """An activation quantized per token already: xq float8 [M, K], x_scale fp32 [M, 1] ->
    [M, N] in ``out_dtype``."""
    return _scaled_mm_rows(xq, x_scale, weight, weight_scale, bias, out_dtype)


@_fp8_linear_rows_op.register_fake
def _fp8_linear_rows_fake(xq, x_scale, weight, weight_scale, bias, out_dtype):  # noqa: ANN001, ANN202
    return xq.new_empty((xq.shape[0], weight.shape[0]), dtype=out_dtype)
