"""The decode GEMV kernels against the torch layers they replace (RMSNorm, F.linear,
SiluAndMul, RotaryEmbedding, the KV write). Runs on the CPU interpreter; on a GPU machine with
``TRITON_INTERPRET=0`` the same cases run compiled on the card."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_device import DEVICE

from pagedserve.kernels import gemv
from pagedserve.layers.activation import SiluAndMul
from pagedserve.layers.layernorm import RMSNorm
from pagedserve.layers.rotary import get_rope

DT = torch.bfloat16
EPS = 1e-5
# Small tiles (several K tiles and programs on these small shapes), and the default tiles.
CONFIGS = [gemv.GemvConfig(8, 64, 4), gemv.GemvConfig(16, 32, 2), None]


def _rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, dtype=torch.float32) * scale).to(DT).to(DEVICE)


def _norm(hidden: int) -> RMSNorm:
    norm = RMSNorm(hidden, EPS, DT, DEVICE)
    with torch.no_grad():
        norm.weight.copy_(_rand(hidden, scale=0.2) + 1)
    return norm


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 outputs of sums over K in a different order: within a few bf16 ulps of the scale."""
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), atol=0.02 * scale, rtol=0.02)


@pytest.mark.parametrize("config", CONFIGS)
def test_linear_row_bias_residual(config: gemv.GemvConfig | None) -> None:
    """K and N not multiples of the tiles: the masked edges count."""
    x, w, b, r = _rand(1, 200), _rand(72, 200, scale=0.1), _rand(72), _rand(1, 72)
    _close(gemv.linear_row(x, w, config=config), F.linear(x, w))
    want = (F.linear(x.float(), w.float(), b.float()) + r.float()).to(DT)
    _close(gemv.linear_row(x, w, b, r, config=config), want)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_rmsnorm_gate_up_silu(config: gemv.GemvConfig | None, with_bias: bool) -> None:
    inter = 40
    x, w, norm = _rand(1, 128), _rand(2 * inter, 128, scale=0.2), _norm(128)
    bias = _rand(2 * inter) if with_bias else None
    got = gemv.rmsnorm_gate_up_silu(x, norm.weight, EPS, w, bias, config=config)
    assert got.shape == (1, inter)
    _close(got, SiluAndMul(DEVICE)(F.linear(norm(x), w, bias)))


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_qkv_rope_kv_write(config: gemv.GemvConfig | None, with_bias: bool) -> None:
    hq, hkv, d, hidden, block_size = 4, 2, 32, 96, 4
    rope = get_rope(d, 64, {"rope_type": "default", "rope_theta": 10000.0}, DT, DEVICE)
    x, norm = _rand(1, hidden), _norm(hidden)
    w = _rand((hq + 2 * hkv) * d, hidden, scale=0.2)
    bias = _rand((hq + 2 * hkv) * d) if with_bias else None
    positions = torch.tensor([37], device=DEVICE)
    cache = torch.zeros(2, 4, block_size, hkv, d, dtype=DT, device=DEVICE)
    q = gemv.rmsnorm_qkv_rope_kv_write(x, norm.weight, EPS, w, bias, rope.cos_sin_cache,
                                       positions, torch.tensor([9], device=DEVICE), cache, hq,
                                       config=config)
    want_q, want_k, want_v = F.linear(norm(x), w, bias).split([hq * d, hkv * d, hkv * d], -1)
    want_q, want_k = rope.rotate(rope.cos_sin(positions), want_q, want_k)
    _close(q, want_q)
    keys, values = cache[0].reshape(-1, hkv * d), cache[1].reshape(-1, hkv * d)
    _close(keys[9], want_k[0])
    _close(values[9], want_v[0])
    others = [s for s in range(16) if s != 9]
    assert keys[others].abs().max() == 0 and values[others].abs().max() == 0


def test_qkv_padding_row_writes_no_kv() -> None:
    """Slot -1 (a padded row of a CUDA-graph batch): queries come out, the cache is untouched."""
    d, hidden = 16, 64
    rope = get_rope(d, 16, {"rope_type": "default", "rope_theta": 10000.0}, DT, DEVICE)
    cache = torch.zeros(2, 2, 4, 1, d, dtype=DT, device=DEVICE)
    q = gemv.rmsnorm_qkv_rope_kv_write(
        _rand(1, hidden), _rand(hidden), EPS, _rand(4 * d, hidden), None, rope.cos_sin_cache,
        torch.tensor([3], device=DEVICE), torch.tensor([-1], device=DEVICE), cache, 2,
        config=gemv.GemvConfig(8, 64, 4))
    assert q.shape == (1, 2 * d) and q.abs().max() > 0
    assert cache.abs().max() == 0


def test_bad_inputs_name_the_argument() -> None:
    w = _rand(16, 32)
    with pytest.raises(ValueError, match="one row"):
        gemv.linear_row(_rand(2, 32), w)
    with pytest.raises(ValueError, match="weight"):
        gemv.linear_row(_rand(1, 24), w)
    with pytest.raises(ValueError, match="residual"):
        gemv.linear_row(_rand(1, 32), w, residual=_rand(1, 15))
    with pytest.raises(ValueError, match="gate_up_weight"):
        gemv.rmsnorm_gate_up_silu(_rand(1, 32), _rand(32), EPS, _rand(15, 32))
    with pytest.raises(ValueError, match="norm_weight"):
        gemv.rmsnorm_gate_up_silu(_rand(1, 32), _rand(31), EPS, w)
    cache = torch.zeros(2, 2, 4, 2, 32, dtype=DT, device=DEVICE)
    with pytest.raises(ValueError, match="qkv_weight"):
        gemv.rmsnorm_qkv_rope_kv_write(
            _rand(1, 32), _rand(32), EPS, _rand(100, 32), None, _rand(8, 32),
            torch.zeros(1, dtype=torch.int64, device=DEVICE),
            torch.zeros(1, dtype=torch.int64, device=DEVICE), cache, 4)
