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
from pagedserve.layers.quantization.fp8_ops import dequantize_rows, quantize_rows
from pagedserve.layers.rotary import get_rope
from pagedserve.platform.base import FP8_MIN_CAPABILITY

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


FP8_KERNELS = pytest.mark.skipif(
    DEVICE.type == "cuda" and torch.cuda.get_device_capability() < FP8_MIN_CAPABILITY,
    reason="Triton's float8_e4m3fn needs compute capability 8.9",
)


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 weight, fp32 scale per row, the dequantized weight in fp32)."""
    q, scale = quantize_rows(w)
    return q, scale, dequantize_rows(q, scale)


@FP8_KERNELS
@pytest.mark.parametrize("config", [CONFIGS[0], None])
def test_fp8_weights_are_read_with_their_row_scales(config: gemv.GemvConfig | None) -> None:
    """Each kernel on FP8 weights against the torch layers on the dequantized weights."""
    x, b, r = _rand(1, 200), _rand(72), _rand(1, 72)
    w8, scale, w = _fp8(_rand(72, 200, scale=0.1))
    want = (F.linear(x.float(), w, b.float()) + r.float()).to(DT)
    _close(gemv.linear_row(x, w8, b, r, config=config, weight_scale=scale), want)

    inter, norm = 40, _norm(128)
    x = _rand(1, 128)
    w8, scale, w = _fp8(_rand(2 * inter, 128, scale=0.2))
    got = gemv.rmsnorm_gate_up_silu(x, norm.weight, EPS, w8, config=config, weight_scale=scale)
    _close(got, SiluAndMul(DEVICE)(F.linear(norm(x), w.to(DT))))


@FP8_KERNELS
def test_fp8_qkv_rope_kv_write() -> None:
    hq, hkv, d, hidden = 4, 2, 32, 96
    rope = get_rope(d, 64, {"rope_type": "default", "rope_theta": 10000.0}, DT, DEVICE)
    x, norm = _rand(1, hidden), _norm(hidden)
    w8, scale, w = _fp8(_rand((hq + 2 * hkv) * d, hidden, scale=0.2))
    positions = torch.tensor([37], device=DEVICE)
    cache = torch.zeros(2, 4, 4, hkv, d, dtype=DT, device=DEVICE)
    q = gemv.rmsnorm_qkv_rope_kv_write(x, norm.weight, EPS, w8, None, rope.cos_sin_cache,
                                       positions, torch.tensor([9], device=DEVICE), cache, hq,
                                       config=gemv.GemvConfig(8, 64, 4), weight_scale=scale)
    want_q, want_k, want_v = F.linear(norm(x), w.to(DT)).split([hq * d, hkv * d, hkv * d], -1)
    want_q, want_k = rope.rotate(rope.cos_sin(positions), want_q, want_k)
    _close(q, want_q)
    _close(cache[0].reshape(-1, hkv * d)[9], want_k[0])
    _close(cache[1].reshape(-1, hkv * d)[9], want_v[0])


@FP8_KERNELS
def test_fp8_inputs_name_the_argument() -> None:
    w8, scale, _ = _fp8(_rand(16, 32))
    with pytest.raises(ValueError, match="expected torch.float8_e4m3fn"):
        gemv.linear_row(_rand(1, 32), _rand(16, 32), weight_scale=scale)
    with pytest.raises(ValueError, match="expected torch.bfloat16"):
        gemv.linear_row(_rand(1, 32), w8)  # FP8 weights need their scale
    with pytest.raises(ValueError, match="weight_scale: expected 16 contiguous fp32"):
        gemv.linear_row(_rand(1, 32), w8, weight_scale=scale[:8])


def test_fp8_weights_get_the_fp8_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher picks its default tile by weight dtype: with a QKV tile of each table that
    does not fit the head, the error names the table of the weights' dtype."""
    rope_kv = int(gemv.EPILOGUE_ROPE_KV)
    monkeypatch.setitem(gemv.DEFAULT_CONFIGS, rope_kv, gemv.GemvConfig(5, 64, 4))
    monkeypatch.setitem(gemv.FP8_CONFIGS, rope_kv, gemv.GemvConfig(3, 64, 4))
    d, hidden = 16, 32
    w = _rand(4 * d, hidden)
    w8, scale, _ = _fp8(w)
    args = (_rand(16, d), torch.tensor([3], device=DEVICE), torch.tensor([0], device=DEVICE),
            torch.zeros(2, 2, 4, 1, d, dtype=DT, device=DEVICE), 2)
    with pytest.raises(ValueError, match="block_n 3 must divide"):
        gemv.rmsnorm_qkv_rope_kv_write(_rand(1, hidden), _rand(hidden), EPS, w8, None, *args,
                                       weight_scale=scale)
    with pytest.raises(ValueError, match="block_n 5 must divide"):
        gemv.rmsnorm_qkv_rope_kv_write(_rand(1, hidden), _rand(hidden), EPS, w, None, *args)


@FP8_KERNELS
def test_fp8_weights_through_fp16_give_the_same_sums() -> None:
    """weight_via="float16" widens FP8 exactly: the same outputs as the direct conversion."""
    x, r = _rand(1, 200), _rand(1, 72)
    w8, scale, _ = _fp8(_rand(72, 200, scale=0.1))
    cfg = gemv.GemvConfig(8, 64, 4)
    via = gemv.GemvConfig(8, 64, 4, weight_via="float16")
    want = gemv.linear_row(x, w8, None, r, config=cfg, weight_scale=scale)
    torch.testing.assert_close(gemv.linear_row(x, w8, None, r, config=via, weight_scale=scale),
                               want, atol=0, rtol=0)
    with pytest.raises(ValueError, match="weight_via"):
        gemv.linear_row(x, _rand(72, 200), None, r, config=via)
