"""oneDNN on packed weights against F.linear (its cache of copies: test_weight_copies.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.layers import cpu_gemv
from pagedserve.layers.cpu_pack_budget import PackBudget
from pagedserve.layers.cpu_packed_linear import PackedLinear, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch without oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 9, 16, 130])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(dtype: torch.dtype, rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 100, generator=gen).to(dtype)[:, :77]  # row stride 100
    w = torch.randn(40, 77, generator=gen).to(dtype)
    bias = torch.randn(40, generator=gen).to(dtype) if with_bias else None
    linear = PackedLinear()  # bf16 without native bf16 here: F.linear, the same numbers
    with torch.inference_mode():
        got = linear(x, w, bias)
    want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.01)
    torch.testing.assert_close(got.float(), want, **tol)


@pytest.mark.parametrize("rows", [1, 9, 130])
@pytest.mark.parametrize("with_bias", [False, True])
def test_emulated_bf16_runs_in_fp32_on_a_widened_copy(rows: int, with_bias: bool) -> None:
    """Without native bf16 matmuls: exact fp32 products and sums of the bf16 values, rounded to
    bf16 once, on an fp32 copy of the weight that the budget counts at 4 bytes an element."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 100, generator=gen).to(torch.bfloat16)[:, :77]  # row stride 100
    w = torch.randn(40, 77, generator=gen).to(torch.bfloat16)
    bias = torch.randn(40, generator=gen).to(torch.bfloat16) if with_bias else None
    budget = PackBudget(lambda: 40 * 77 * 4, share=1.0)  # room for the fp32 copy, no more
    linear = PackedLinear(native_bf16=False, budget=budget)
    with torch.inference_mode():
        got = linear(x, w, bias)
    assert got.dtype == torch.bfloat16
    assert linear.widened.get(w) is not None and len(linear.copies) == 0
    assert not budget.take(1, "another copy")
    want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    torch.testing.assert_close(got, want.to(torch.bfloat16), atol=1e-5, rtol=2**-8)


def test_leaves_autograd_to_f_linear() -> None:
    wf = torch.randn(8, 32, requires_grad=True)
    assert not PackedLinear().takes(torch.randn(16, 32), wf)


def test_cpu_linear_sends_many_fp32_rows_to_it() -> None:
    linear = cpu_gemv.cpu_linear()
    x, w = torch.randn(2, 20, 32), torch.randn(8, 32)
    with torch.inference_mode():
        got = linear(x, w, None)
    assert got.shape == (2, 20, 8)
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-4, rtol=1e-5)
    if isinstance(linear, cpu_gemv.GemvKernel):
        assert isinstance(linear.large, PackedLinear)


def test_a_weight_over_the_budget_runs_f_linear() -> None:
    budget = PackBudget(lambda: 8 * 32 * 4, share=1.0)  # room for one [8, 32] fp32 copy
    linear = PackedLinear(budget=budget)
    x, w1, w2 = torch.randn(16, 32), torch.randn(8, 32), torch.randn(8, 32)
    with torch.inference_mode():
        assert linear.copies.get(w1) is not None
        assert linear.copies.get(w2) is None
        torch.testing.assert_close(linear(x, w2, None), F.linear(x, w2), atol=1e-4, rtol=1e-5)
        del w1  # its copy's bytes come back
        assert linear.copies.get(w2) is not None
