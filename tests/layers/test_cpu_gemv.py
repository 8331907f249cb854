"""The CPU's few-row bf16 linear kernel against an fp32 reference, and where it steps aside."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.layers import cpu_gemv
from pagedserve.layers.cpu_packed_linear import PackedLinear, packing_available
from pagedserve.layers.panel_pack import PANEL_MAX_ROWS, PANEL_MIN_ROWS, panel_copies


@pytest.fixture(scope="module")
def kernel() -> cpu_gemv.GemvKernel:
    linear = cpu_gemv.cpu_linear()
    if not isinstance(linear, cpu_gemv.GemvKernel):
        pytest.skip("no C compiler here: the CPU uses F.linear")
    return linear


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 sums of the exact products, rounded to bf16 once."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w.float(), b).to(torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])  # 7: a block of 4 rows, then 3
@pytest.mark.parametrize(("k", "n"), [(64, 8), (77, 13), (576, 960)])  # a tail of k, of n
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_fp32_sums(kernel, rows: int, k: int, n: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16) if with_bias else None
    torch.testing.assert_close(kernel(x, w, bias), reference(x, w, bias), atol=0.05, rtol=0.01)


def test_reads_rows_through_their_stride(kernel) -> None:
    qkv = torch.randn(2, 96).to(torch.bfloat16)
    x = qkv[:, :64]  # [2, 64], row stride 96
    w = torch.randn(16, 64).to(torch.bfloat16)
    torch.testing.assert_close(kernel(x, w), reference(x, w, None), atol=0.05, rtol=0.01)


def test_keeps_leading_dims(kernel) -> None:
    x = torch.randn(1, 3, 32).to(torch.bfloat16)
    w = torch.randn(8, 32).to(torch.bfloat16)
    assert kernel(x, w).shape == (1, 3, 8)


@pytest.mark.parametrize(("rows", "dtype"), [(0, torch.bfloat16), (1, torch.float16)])
def test_other_inputs_go_to_f_linear(kernel, rows: int, dtype: torch.dtype) -> None:
    x = torch.randn(rows, 32).to(dtype)
    w = torch.randn(8, 32).to(dtype)
    assert not kernel.applies(x, w, None) and not kernel.takes_few_rows(x, w, None)
    torch.testing.assert_close(kernel(x, w), F.linear(x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 4, 8])
@pytest.mark.parametrize(("k", "n"), [(77, 13), (576, 960)])
def test_few_rows_match_fp32_sums(kernel, dtype: torch.dtype, rows: int, k: int,
                                  n: int) -> None:
    """``gemv_rows`` (where vectorized): bf16 or fp32, strided rows of x, a bias."""
    if not kernel.rows_vectorized:
        pytest.skip("gemv_rows is not vectorized on this CPU")
    gen = torch.Generator().manual_seed(rows + k + n)
    x = torch.randn(rows, k + 3, generator=gen).to(dtype)[:, :k]  # [rows, k], row stride k + 3
    w = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    assert kernel.takes_few_rows(x, w, bias)
    want = F.linear(x.float(), w.float(), bias.float()).to(dtype)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.01)
    torch.testing.assert_close(kernel(x, w, bias), want, **tol)


def test_native_bf16_keeps_large_batches_on_torch(kernel) -> None:
    native = cpu_gemv.GemvKernel(kernel.path, cpu_gemv.SMALL_BATCH_ROWS)
    w = torch.randn(8, 32).to(torch.bfloat16)
    assert native.applies(torch.randn(cpu_gemv.SMALL_BATCH_ROWS, 32).to(torch.bfloat16), w, None)
    assert not native.applies(torch.randn(5, 32).to(torch.bfloat16), w, None)
    emulated = cpu_gemv.GemvKernel(kernel.path, None)
    assert emulated.applies(torch.randn(64, 32).to(torch.bfloat16), w, None)


@pytest.mark.skipif(not packing_available(), reason="torch without oneDNN")
def test_emulated_bf16_sends_many_rows_to_the_widened_product(kernel) -> None:
    """Without native bf16: up to WIDENED_MIN_ROWS - 1 rows on ``gemv_bf16``, more (beyond
    the panels' rows) on oneDNN's fp32 product over the weight's widened copy."""
    few = cpu_gemv.WIDENED_MIN_ROWS - 1
    large = PackedLinear(native_bf16=False)
    emulated = cpu_gemv.GemvKernel(kernel.path, few, large)
    w = torch.randn(24, 32).to(torch.bfloat16)
    assert emulated.applies(torch.randn(few, 32).to(torch.bfloat16), w, None)
    assert not emulated.applies(torch.randn(few + 1, 32).to(torch.bfloat16), w, None)
    x = torch.randn(PANEL_MAX_ROWS + 1, 32).to(torch.bfloat16)
    got = emulated(x, w, None)
    assert large.widened.has(w)
    torch.testing.assert_close(got, reference(x, w, None), atol=1e-5, rtol=2**-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [PANEL_MIN_ROWS, 16, PANEL_MAX_ROWS])
def test_panel_rows_run_on_the_weights_panel_copy(kernel, dtype: torch.dtype, rows: int) -> None:
    """From PANEL_MIN_ROWS to PANEL_MAX_ROWS rows: ``gemm_panels`` on the weight's shared panel
    copy, made on the first call; strided rows, a bias, n not a multiple of 16."""
    if dtype not in kernel.panel_dtypes:
        pytest.skip(f"no panel kernel for {dtype} in this build")
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64 + 3, generator=gen).to(dtype)[:, :64]  # row stride 67
    w = torch.randn(40, 64, generator=gen).to(dtype)
    bias = torch.randn(40, generator=gen).to(dtype)
    copies = panel_copies()
    before = len(copies)
    got = kernel(x, w, bias)
    assert len(copies) == before + 1 and copies.get(w) is not None
    want = F.linear(x.float(), w.float(), bias.float()).to(dtype)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.01)
    torch.testing.assert_close(got, want, **tol)
    del w
    assert len(copies) == before  # a dead weight's copy goes with it


def test_more_rows_than_panels_take_go_to_the_large_linear(kernel) -> None:
    x, w = torch.randn(PANEL_MAX_ROWS + 1, 32), torch.randn(8, 32)
    copies = panel_copies()
    before = len(copies)
    torch.testing.assert_close(kernel(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)
    assert len(copies) == before
