"""``panel_gemm.h`` (through ``cpu_gemv.c``'s ``gemm_panels``) on weights packed by
``panel_pack`` against fp32 sums."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagedserve.layers import cpu_gemv
from pagedserve.layers.panel_pack import panel_pack, panel_pack_widened
from tests.attention.avx2_build import built_for_avx2


def _gemm_panels(path: Path) -> tuple[ctypes._CFuncPtr, bool]:
    """The library's ``gemm_panels`` and whether it widens bf16 panels."""
    library = ctypes.CDLL(str(path))
    fn = library.gemm_panels
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + [ctypes.c_int] * 2
    fn.restype = ctypes.c_int
    return fn, bool(library.gemm_panels_widens_bf16())


@pytest.fixture(scope="module", params=["native", "x86-64-v3"])
def gemm_panels(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> tuple[ctypes._CFuncPtr, bool]:
    """The library built for this CPU, and for AVX2 + FMA alone (x86-64-v3: fp32 panels, bf16
    ones widened), so that machines with AVX512 check that build too."""
    linear = cpu_gemv.cpu_linear()
    if not isinstance(linear, cpu_gemv.GemvKernel):
        pytest.skip("no CPU kernel library here")
    if request.param == "native":
        return _gemm_panels(linear.path)
    fn, widens = _gemm_panels(built_for_avx2(cpu_gemv.SOURCE, tmp_path_factory.mktemp("avx2")))
    assert widens  # no AVX512-BF16 in that build
    return fn, widens


def test_pack_layout() -> None:
    w = torch.arange(20 * 4, dtype=torch.float32).view(20, 4)  # n 20: a panel and a part
    packed = panel_pack(w)  # [2, 4, 16]
    assert packed.shape == (2, 4, 16)
    assert torch.equal(packed[1, :, :4], w[16:].t()) and not packed[1, :, 4:].any()
    wb = w.to(torch.bfloat16)
    assert torch.equal(panel_pack(wb)[0, 1, 3], wb[3, 2:4])  # [P, k/2, 16, 2]
    assert torch.equal(panel_pack_widened(wb), panel_pack(wb.float()))  # fp32 panels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(32, 6), (16, 2), (16, 1), (48, 576)])
def test_pack_of_whole_panels_is_a_copy(dtype: torch.dtype, n: int, k: int) -> None:
    """n a multiple of 16 (no padding): the same layout, in memory of its own, also where a
    panel's transpose is a single word wide (bf16 k 2, fp32 k 1)."""
    if dtype == torch.bfloat16 and k % 2:
        pytest.skip("bf16 needs an even k")
    w = torch.randn(n, k).to(dtype)
    packed = panel_pack(w)
    want = w.view(-1, 16, k).transpose(1, 2)  # [P, k, 16]
    if dtype == torch.bfloat16:
        want = w.view(-1, 16, k // 2, 2).permute(0, 2, 1, 3)  # [P, k/2, 16, 2]
    assert packed.is_contiguous() and torch.equal(packed, want)
    assert packed.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 7, 8, 9, 12, 16, 19])  # blocks of 6 (AVX2), 8
@pytest.mark.parametrize(("k", "n"), [(6, 13), (64, 40), (576, 960)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_fp32_sums(gemm_panels, dtype: torch.dtype, rows: int, k: int, n: int,
                           with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 7 + k + n)
    x = torch.randn(rows, k + 2, generator=gen).to(dtype)[:, :k]  # row stride k + 2
    w = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    fn, widens = gemm_panels
    packed, out = (panel_pack_widened if widens else panel_pack)(w), torch.empty(rows, n, dtype=dtype)
    status = fn(x.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(),
                         out.data_ptr(), rows, n, k, k + 2, n, int(dtype == torch.bfloat16), 1)
    if status == 1:
        pytest.skip("no panel kernel for this dtype here")
    want = F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(dtype)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.01)
    torch.testing.assert_close(out, want, **tol)
