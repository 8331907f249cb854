"""The SiLU-and-mul kernel against SiluAndMul's torch code on the CPU (its reference); the
kernel runs on the GPU when there is one, else under the interpreter."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE

from pagedserve.kernels.silu_and_mul import silu_and_mul
from pagedserve.layers.activation import silu_and_mul_torch

TOL = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


@pytest.mark.parametrize("d", [64, 300, 1536])  # one block, a partial block, several blocks
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_the_torch_code(d: int, dtype: torch.dtype) -> None:
    x = (torch.randn(5, 2 * d) * 4).to(dtype)
    got = silu_and_mul(x.to(DEVICE), block=256, num_warps=4).cpu()
    want = silu_and_mul_torch(x)
    assert got.dtype == dtype and got.shape == (5, d)
    # The same two roundings as the eager torch code; exp may differ in its last fp32 bit
    # between libraries, which can move a result by one rounding step.
    tol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if dtype != torch.float32:  # in 16 bits, nearly every result is the same number
        assert (got == want).float().mean() > 0.99


def test_strided_rows_and_no_rows() -> None:
    base = torch.randn(4, 3 * 32).to(torch.bfloat16)
    x = base[:, :64]  # rows of a wider buffer
    assert torch.equal(silu_and_mul(x.to(DEVICE)).cpu(), silu_and_mul_torch(x))
    assert silu_and_mul(torch.empty(0, 64, device=DEVICE)).shape == (0, 32)


def test_rejects_an_odd_width() -> None:
    with pytest.raises(ValueError, match="silu_and_mul: x must be"):
        silu_and_mul(torch.zeros(2, 7, device=DEVICE))
