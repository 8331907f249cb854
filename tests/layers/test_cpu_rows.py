"""The CPU's row kernels (layers/cpu_rows.c) against the torch code they replace."""

from __future__ import annotations

import pytest
import torch

from pagedserve.attention.backends.torch_ref import TorchRefBackend
from pagedserve.layers import cpu_rows
from pagedserve.layers.activation import SiluAndMul, silu_and_mul_torch
from pagedserve.layers.layernorm import RMSNorm, _normalize, add_rms_norm_torch

DTYPES = [torch.float32, torch.bfloat16]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """fp32: equal up to the sum order; bf16: at most one rounding step apart."""
    if a.dtype == torch.float32:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)
        assert (a != b).float().mean() < 1e-3


@pytest.fixture(autouse=True)
def _built() -> None:
    if cpu_rows._library() is None:
        pytest.skip("no C compiler")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("n", [96, 90])  # whole 16-lane vectors; a width that is not
def test_add_rms_norm(dtype: torch.dtype, threads: int, n: int,
                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    x, residual = torch.randn(37, n).to(dtype), (torch.randn(37, n) * 10).to(dtype)
    weight = torch.randn(n).to(dtype)
    rows = cpu_rows.add_rms_norm_rows(x, residual, weight, 1e-6)
    assert rows is not None and rows[1] is not None
    normed, summed = add_rms_norm_torch(x, residual, weight, 1e-6)
    _close(rows[0], normed)
    assert torch.equal(rows[1], summed)
    plain = cpu_rows.add_rms_norm_rows(x, None, weight, 1e-6)
    assert plain is not None and plain[1] is None
    _close(plain[0], _normalize(x.float(), weight, 1e-6, dtype))


def test_rmsnorm_module_uses_the_kernel_and_falls_back() -> None:
    norm = RMSNorm(64, 1e-5, torch.float32, torch.device("cpu"))
    x = torch.randn(4, 64)
    assert isinstance(norm(x), torch.Tensor)
    out, res = norm(x, x)
    torch.testing.assert_close(res, 2 * x)
    strided = torch.randn(4, 128)[:, :64]  # not contiguous: the torch code
    assert cpu_rows.add_rms_norm_rows(strided, None, norm.weight, 1e-5) is None
    torch.testing.assert_close(norm(strided), _normalize(strided, norm.weight, 1e-5, x.dtype))
    half = torch.randn(4, 64).half()
    assert cpu_rows.add_rms_norm_rows(half, None, norm.weight.half(), 1e-5) is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [80, 37, 7])  # whole 16-lane vectors, then a tail, tail only
def test_silu_and_mul_on_strided_rows(dtype: torch.dtype, d: int) -> None:
    x = (torch.randn(19, 2 * d + 16) * 4).to(dtype)[:, : 2 * d]  # row stride 2 d + 16
    out = cpu_rows.silu_and_mul_rows(x)
    assert out is not None
    _close(out, silu_and_mul_torch(x))
    _close(SiluAndMul(torch.device("cpu"))(x), silu_and_mul_torch(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [500.0, 1e30])
def test_silu_and_mul_of_gates_far_from_zero(dtype: torch.dtype, scale: float) -> None:
    """Gates below expf's overflow (about -88): silu is -0 there, as torch's, not NaN; gates
    far above zero: silu is the gate (e^-gate is 0), not a lost exponential."""
    x = torch.cat([torch.randn(9, 512) * scale, torch.randn(9, 512)], dim=1).to(dtype)
    out = cpu_rows.silu_and_mul_rows(x)
    assert out is not None and bool(torch.isfinite(out).all())
    _close(out, silu_and_mul_torch(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("d", [32, 64, 24])  # the 16-lane pass: one, two vectors; a half of 12
def test_rope_and_kv_write(dtype: torch.dtype, block_size: int, d: int) -> None:
    """Slots across block boundaries, in any order; -1 writes nothing; q/k/v split from one
    qkv row as the attention layer hands them over."""
    m, hq, hkv = 23, 4, 2
    num_blocks = 48 // block_size + 1
    qkv = torch.randn(m, (hq + 2 * hkv) * d).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    cos_sin = torch.randn(m, d).to(dtype)
    slots = torch.randperm(num_blocks * block_size)[:m]
    slots[3] = -1
    ours = torch.zeros(2, num_blocks, block_size, hkv, d, dtype=dtype)
    ref = ours.clone()
    rotated = cpu_rows.rope_and_write_kv_rows(q, k, v, cos_sin, ours, slots)
    assert rotated is not None
    expected = TorchRefBackend().rope_and_write_kv(q, k, v, cos_sin, ref, slots)
    torch.testing.assert_close(rotated, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)


def test_rope_refuses_a_slot_past_the_cache() -> None:
    q, k, v = torch.randn(2, 64), torch.randn(2, 32), torch.randn(2, 32)
    cache = torch.zeros(2, 1, 4, 1, 32)
    with pytest.raises(ValueError, match="slot"):
        cpu_rows.rope_and_write_kv_rows(q, k, v, torch.randn(2, 32), cache,
                                        torch.tensor([0, 4]))
    fp16 = cpu_rows.rope_and_write_kv_rows(q.half(), k.half(), v.half(), torch.randn(2, 32).half(),
                                           cache.half(), torch.tensor([0, 1]))
    assert fp16 is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 16, 49, 49152])  # below, at and past a vector of 16
def test_argmax_rows_matches_torch(dtype: torch.dtype, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(5, n + 3, generator=gen).to(dtype)[:, :n]  # strided rows
    torch.testing.assert_close(cpu_rows.argmax_rows(x), x.float().argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_takes_the_first_of_equal_maxima(dtype: torch.dtype) -> None:
    """Ties in one lane, across lanes, between the vector part and the tail; a row of -inf."""
    x = torch.zeros(4, 40, dtype=dtype)
    x[0, [5, 21]] = 3.0  # lane 5, twice
    x[1, [9, 6, 38]] = 2.0  # lanes 9 and 6 (first index wins, not first lane), and the tail
    x[2, [37, 39]] = 1.0  # the tail only
    x[3] = float("-inf")
    assert cpu_rows.argmax_rows(x).tolist() == x.float().argmax(dim=-1).tolist() == [5, 6, 37, 0]


def test_greedy_sampling_takes_the_kernel_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedserve.sample import token_sampler

    x = torch.randn(3, 100).to(torch.bfloat16)
    calls = []
    kernel = cpu_rows.argmax_rows
    monkeypatch.setattr(cpu_rows, "argmax_rows", lambda t: calls.append(t) or kernel(t))
    assert token_sampler.greedy_argmax(x).tolist() == x.float().argmax(dim=-1).tolist()
    assert len(calls) == 1
