"""The per-token FP8 quantization kernel against ``fp8_ops.quantize_rows`` (its reference):
the same bytes and scales, in the one-pass kernel (rows of up to ONE_PASS_MAX_COLS) and the
two-pass one (wider rows), and the FP8 linear op that quantizes its input with it. Runs
under the interpreter in CI, compiled on a GPU with ``TRITON_INTERPRET=0``."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE

from pagedserve.kernels.fp8_rows import ONE_PASS_MAX_COLS, quantize_rows_fp8
from pagedserve.layers.quantization import fp8_ops
from pagedserve.layers.quantization.fp8_ops import FP8_MAX, quantize_rows


def _assert_quantized(x: torch.Tensor, num_warps: int | None = None) -> None:
    """quantize_rows_fp8(x) on DEVICE gives quantize_rows(x)'s bytes and scales."""
    q, scale = quantize_rows_fp8(x.to(DEVICE), num_warps)  # float8 [T, K], fp32 [T, 1]
    want_q, want_scale = quantize_rows(x)  # float8 [T, K], fp32 [T]
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (x.shape[0], 1)
    assert torch.equal(scale.cpu().squeeze(1), want_scale)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))


def _rows(num_tokens: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, K] of mixed magnitudes, an all-zero row and an outlier where there are rows."""
    x = torch.randn(num_tokens, k) * torch.logspace(-3, 2, num_tokens).unsqueeze(1)  # [T, K]
    if num_tokens > 1:
        x[1] = 0.0
    x[0, k // 3] = -300.0 * float(x[0].abs().max())  # crushes the rest of its row
    return x.to(dtype)


@pytest.mark.parametrize("k", [64, 3000, 4096])
@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_one_pass_matches_quantize_rows(num_tokens: int, k: int) -> None:
    _assert_quantized(_rows(num_tokens, k, torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_input_dtypes(dtype: torch.dtype) -> None:
    _assert_quantized(_rows(5, 1000, dtype))


def test_widest_one_pass_row_and_warp_counts() -> None:
    """Llama-3-8B's MLP width, one block of 16,384 columns, at the swept warp counts."""
    assert 14336 <= ONE_PASS_MAX_COLS
    x = _rows(2, 14336, torch.bfloat16)
    for num_warps in (None, 4, 16):
        _assert_quantized(x, num_warps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_wider_than_one_program_take_two_passes(dtype: torch.dtype) -> None:
    k = 20000
    assert k > ONE_PASS_MAX_COLS
    x = _rows(3, k, dtype)
    x[2, k - 1] = 5000.0  # the row's largest magnitude, in its last partial block
    _assert_quantized(x)


def test_values_past_the_fp8_range_saturate() -> None:
    """For these amaxes amax / (amax / 448) lands just above 448 in fp32: the row's largest
    value still comes out as +-448, never NaN."""
    amax = torch.tensor([665.1151123046875, 116.66626739501953])  # fp32 [2]
    assert (amax / (amax / FP8_MAX) > FP8_MAX).all()
    x = torch.tensor([[1.0, float(-amax[0]), 3.0], [float(amax[1]), -1.0, 0.0]])  # fp32 [2, 3]
    _assert_quantized(x)
    q, _ = quantize_rows_fp8(x.to(DEVICE))
    assert q.cpu().float().abs().amax(dim=1).tolist() == [FP8_MAX, FP8_MAX]


def test_strided_rows_and_no_rows() -> None:
    base = torch.randn(4, 3 * 96).bfloat16()
    _assert_quantized(base[:, :96])  # rows of a wider buffer
    q, scale = quantize_rows_fp8(torch.empty(0, 64, device=DEVICE))
    assert q.shape == (0, 64) and scale.shape == (0, 1)


def test_rejects_other_shapes() -> None:
    with pytest.raises(ValueError, match="quantize_rows_fp8: x must be"):
        quantize_rows_fp8(torch.zeros(2, 3, 4, device=DEVICE))


def test_fp8_linear_quantizes_its_input_with_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pagedserve::fp8_linear`` with a per-token scale, its kernel branch (CUDA's) taken on
    this device: the product gets ``quantize_rows``'s bytes and scales, from the kernel."""
    calls, products = [], []

    def kernel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(x.shape)
        q, scale = quantize_rows_fp8(x.to(DEVICE))
        return q.to(x.device), scale.to(x.device)

    def product(xq, x_scale, weight, weight_scale, bias, out_dtype):  # noqa: ANN001, ANN202
        products.append((xq, x_scale))
        return torch.zeros(xq.shape[0], weight.shape[0], dtype=out_dtype)

    weight, weight_scale = quantize_rows(torch.randn(32, 64) * 0.05)  # float8 [N, K], fp32 [N]
    x = (torch.randn(5, 64) * 4).bfloat16()  # [M, K]
    monkeypatch.setattr(fp8_ops, "_row_kernel_for", lambda t: kernel)
    monkeypatch.setattr(fp8_ops, "_scaled_mm_rows", product)
    fp8_ops._fp8_linear_op(x, weight, weight_scale, None, None)
    assert calls == [(5, 64)]
    want_q, want_scale = quantize_rows(x)  # float8 [M, K], fp32 [M]
    (xq, x_scale), = products
    assert torch.equal(xq.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(x_scale, want_scale.unsqueeze(1))
