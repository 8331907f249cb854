"""The RMSNorm and SiLU-and-mul kernels that write FP8 with a scale per row, against the torch
quantization (``fp8_ops.quantize_rows``) of the plain kernels' outputs, which their own tests
hold to the torch layers: the same rows, quantized in the same pass, so the bytes and scales
are equal. Runs under the interpreter in CI, compiled on a GPU with ``TRITON_INTERPRET=0``."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE

from pagedserve.kernels.fp8_rows import ONE_PASS_MAX_COLS
from pagedserve.kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_fp8
from pagedserve.kernels.silu_and_mul import (
    silu_and_mul,
    silu_and_mul_fp8,
    silu_and_mul_fp8_two_pass,
)
from pagedserve.layers.quantization.fp8_ops import quantize_rows


def _assert_quantized(q: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor) -> None:
    """(q, scale) as quantize_rows gives them for ``rows`` [T, K]."""
    want_q, want_scale = quantize_rows(rows.cpu())
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (rows.shape[0], 1)
    assert torch.equal(scale.cpu().squeeze(1), want_scale)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize(("dtype", "hidden"), [(torch.bfloat16, 200), (torch.float32, 64)])
def test_rms_norm_fp8_is_the_norm_quantized_per_row(dtype: torch.dtype, hidden: int) -> None:
    x = torch.randn(4, hidden).to(dtype).to(DEVICE)
    residual = (torch.randn(4, hidden) * 20).to(dtype).to(DEVICE)
    x[2] = -residual[2]  # an all-zero row: the smallest scale, zeros
    weight = torch.randn(hidden).to(dtype).to(DEVICE)
    normed, summed = fused_add_rms_norm(x, residual, weight, 1e-5)
    q, scale, summed_fp8 = fused_add_rms_norm_fp8(x, residual, weight, 1e-5)
    assert torch.equal(summed_fp8, summed)
    _assert_quantized(q, scale, normed)


def test_silu_and_mul_fp8_two_pass_is_the_product_quantized_per_row() -> None:
    """d = 200 in blocks of 64: the row's largest magnitude is taken over all of them."""
    x = torch.randn(3, 400).bfloat16().to(DEVICE)
    x[1, 250] = 40.0  # an up value far out, in the last block
    q, scale = silu_and_mul_fp8_two_pass(x, block=64, num_warps=2)
    _assert_quantized(q, scale, silu_and_mul(x))


@pytest.mark.parametrize(
    ("dtype", "d"),
    [(torch.bfloat16, 200), (torch.float16, 64), (torch.float32, 300), (torch.bfloat16, 14336)],
)
def test_silu_and_mul_fp8_one_pass_is_the_product_quantized_per_row(
    dtype: torch.dtype, d: int
) -> None:
    """The whole row in one block (a partial one but for d = 64), up to Llama-3-8B's width."""
    x = (torch.randn(3, 2 * d) * 3).to(dtype).to(DEVICE)
    x[0] = 0.0  # an all-zero row: the smallest scale, zeros
    x[1, d + d // 2] = 1000.0  # an up value far out
    q, scale = silu_and_mul_fp8(x)
    _assert_quantized(q, scale, silu_and_mul(x))
    q2, scale2 = silu_and_mul_fp8(x, num_warps=4)
    assert torch.equal(scale2, scale) and torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


def test_silu_and_mul_fp8_wider_than_one_program_takes_two_passes() -> None:
    """A row of more than ONE_PASS_MAX_COLS products goes to the two-pass kernel."""
    d = ONE_PASS_MAX_COLS + 100
    x = torch.randn(2, 2 * d).bfloat16().to(DEVICE)
    x[1, 2 * d - 1] = 50.0  # the row's largest product, in its last block
    q, scale = silu_and_mul_fp8(x)
    _assert_quantized(q, scale, silu_and_mul(x))


def test_silu_and_mul_fp8_no_rows() -> None:
    q, scale = silu_and_mul_fp8(torch.empty(0, 64, device=DEVICE))
    assert q.shape == (0, 32) and scale.shape == (0, 1)
