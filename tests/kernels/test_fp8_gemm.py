"""The Triton FP8 GEMMs (per-tile and persistent TMA) against the product of their dequantized
operands in float64, row-wise and per-tensor scales, ragged edges in M, N and K. Runs under the interpreter in CI, compiled
on a GPU with ``TRITON_INTERPRET=0``."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE

from pagedserve.kernels.fp8_gemm import (
    NARROW_TILES,
    WIDE_TILES,
    Fp8GemmConfig,
    fp8_gemm,
    fp8_gemm_persistent,
    persistent_config_for,
    wave_fill,
)
from pagedserve.layers.quantization.fp8_ops import FP8_MAX, quantize_rows

SMALL = Fp8GemmConfig(16, 32, 32, group_m=2, num_warps=4, num_stages=2)


def _reference(a, a_scale, b, b_scale) -> torch.Tensor:  # noqa: ANN001
    """fp64 [M, N] of the dequantized operands."""
    a64 = a.cpu().double() * a_scale.cpu().double().reshape(-1, 1)
    b64 = b.cpu().double() * b_scale.cpu().double().reshape(-1, 1)
    return a64 @ b64.T


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.dtype == torch.bfloat16 and not torch.isnan(out).any()
    return float((out.cpu().double() - ref).norm() / ref.norm())


def _rowwise_operands(m: int, n: int, k: int) -> tuple[torch.Tensor, ...]:
    """(a float8 [M, K], a_scale [M, 1], b float8 [N, K], b_scale [N, 1]) on the CPU."""
    a, a_scale = quantize_rows(torch.randn(m, k) * 3)
    b, b_scale = quantize_rows(torch.randn(n, k) * 0.02)
    return a, a_scale.unsqueeze(1), b, b_scale.unsqueeze(1)


@pytest.mark.parametrize(("m", "n", "k"), [(37, 70, 100), (16, 32, 64)])
def test_rowwise_scales(m: int, n: int, k: int) -> None:
    operands = _rowwise_operands(m, n, k)
    out = fp8_gemm(*(t.to(DEVICE) for t in operands), SMALL)
    # fp32 sums of exact FP8 products, one bf16 rounding at the end
    assert _rel_err(out, _reference(*operands)) < 5e-3


@pytest.mark.parametrize(("m", "n", "k", "programs"), [(37, 80, 96, 3), (100, 48, 160, 2)])
def test_persistent_kernel_covers_every_tile(m: int, n: int, k: int, programs: int) -> None:
    """Fewer programs than output tiles (3 x 3 and 7 x 2 here): each loops over several,
    and the tiles past M, N and K's edges are zero-filled on load and clipped on store."""
    operands = _rowwise_operands(m, n, k)
    out = fp8_gemm_persistent(*(t.to(DEVICE) for t in operands), SMALL, num_programs=programs)
    assert _rel_err(out, _reference(*operands)) < 5e-3


@pytest.mark.parametrize(
    ("m", "n", "expected"),
    [
        (512, 4096, NARROW_TILES),  # 64 wide tiles fill 64 of 132 SMs, 128 narrow ones 128
        (512, 6144, WIDE_TILES),  # 96 wide (0.73 of a wave), 192 narrow (0.73 of two)
        (512, 28672, NARROW_TILES),  # 448 wide: 0.85 of four waves; 896 narrow: 0.97 of seven
        (8192, 4096, WIDE_TILES),  # 1,024 wide: 0.97 of eight waves
    ],
)
def test_launch_shape_fills_the_last_wave(m: int, n: int, expected: Fp8GemmConfig) -> None:
    """On an H100's 132 SMs: 128 x 256 tiles unless 128 x 128 ones fill clearly more of the
    last wave's SM slots."""
    assert persistent_config_for(m, n, 132) is expected
    assert wave_fill(512, 4096, WIDE_TILES, 132) == pytest.approx(64 / 132)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the engine's launch shapes need a GPU's SMEM")
@pytest.mark.parametrize("config", [WIDE_TILES, NARROW_TILES, None])
def test_persistent_kernel_engine_launch_shapes(config: Fp8GemmConfig | None) -> None:
    """The two launch shapes the engine picks from, and its pick (None), on ragged edges."""
    operands = _rowwise_operands(300, 4000, 528)
    out = fp8_gemm_persistent(*(t.to(DEVICE) for t in operands), config)
    assert _rel_err(out, _reference(*operands)) < 5e-3


def test_per_tensor_scales() -> None:
    x, w = torch.randn(20, 96), torch.randn(50, 96) * 0.1
    a_scale = (x.abs().amax() / FP8_MAX).reshape(1)  # fp32 [1]
    b_scale = (w.abs().amax() / FP8_MAX).reshape(1)
    a, b = (x / a_scale).to(torch.float8_e4m3fn), (w / b_scale).to(torch.float8_e4m3fn)
    out = fp8_gemm(a.to(DEVICE), a_scale.to(DEVICE), b.to(DEVICE), b_scale.to(DEVICE), SMALL)
    assert _rel_err(out, _reference(a, a_scale, b, b_scale)) < 5e-3


def test_bad_input_is_named() -> None:
    a = torch.zeros(4, 32).to(torch.float8_e4m3fn)
    one = torch.ones(1)
    with pytest.raises(ValueError, match="b: K = 16"):
        fp8_gemm(a, one, torch.zeros(8, 16).to(torch.float8_e4m3fn), one, SMALL)
    with pytest.raises(ValueError, match="a_scale"):
        fp8_gemm(a, torch.ones(3), a, one, SMALL)
    with pytest.raises(ValueError, match="a: a row-major float8"):
        fp8_gemm(a.float(), one, a, one, SMALL)
    with pytest.raises(ValueError, match="block_k"):
        Fp8GemmConfig(16, 16, 16)
