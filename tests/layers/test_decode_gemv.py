"""The decode step's matrix product (``layers/decode_gemv.h``, through ``decode_linear`` of
``model/cpu_decode.c``) against fp32 sums: tails of k and n, blocks of rows, bias, both
weight dtypes, several threads."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from pagedserve.attention.backends.cpu_native import built_library
from pagedserve.model.cpu_decode import SOURCE, load_decode_step

pytestmark = pytest.mark.skipif(load_decode_step() is None, reason="no C compiler here")


@pytest.fixture(scope="module")
def decode_linear() -> Callable[..., int]:
    fn = ctypes.CDLL(str(built_library(SOURCE))).decode_linear
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    fn.restype = ctypes.c_int
    return fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 13])  # 7: blocks of 3, 3, 1; 13: interleaved
@pytest.mark.parametrize(("k", "n"), [(64, 8), (77, 13), (576, 960)])  # tails of k and of n
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_fp32_sums(decode_linear, dtype: torch.dtype, rows: int, k: int, n: int,
                           with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=gen).to(dtype).float()  # [rows, k]: values of dtype
    w = torch.randn(n, k, generator=gen).to(dtype)  # [n, k]
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None  # [n]
    want = F.linear(x, w.float(), None if bias is None else bias.float()).to(dtype).float()
    for threads in (1, 2):
        y = torch.empty(rows, n)  # [rows, n]
        assert decode_linear(x.data_ptr(), w.data_ptr(), None if bias is None else
                             bias.data_ptr(), y.data_ptr(), rows, n, k,
                             int(dtype == torch.bfloat16), threads) == 0
        tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.01)
        torch.testing.assert_close(y, want, **tol)
