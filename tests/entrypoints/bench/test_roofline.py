"""The rooflines count the bytes and FLOPs of the run's precision (FP8 weights / KV cache)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedserve.config import CacheConfig, EngineConfig, ModelConfig
from pagedserve.entrypoints.bench.roofline import (
    ASSUMED_FP8_MATMUL_SPEEDUP,
    MODEL_DTYPE,
    Ceilings,
    Precision,
    decode_step_roofline,
    run_precision,
    throughput_roofline,
)
from pagedserve.model.shape import ModelShape

LLAMA_3_8B = ModelShape(num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                        ffn=14336, vocab=128256)  # fmt: skip
H200 = Ceilings(4.25e12, 800e12, "test")
FP8 = Precision.of_run(2, "fp8", "fp8")


def test_weight_floor_matches_the_documented_bf16_and_fp8_figures() -> None:
    # BENCHMARKS.md: one step's linear work reads 3.532 ms of bf16 weights and 1.889 ms of FP8
    # layer weights plus the bf16 LM head, at 4.25 TB/s (context 0: no KV reads).
    assert decode_step_roofline(LLAMA_3_8B, 1, 0, H200) * 1e3 == pytest.approx(3.532, abs=5e-4)
    assert decode_step_roofline(LLAMA_3_8B, 1, 0, H200, FP8) * 1e3 == pytest.approx(1.889, abs=5e-4)


def test_fp8_kv_cache_halves_the_kv_bytes() -> None:
    kv16 = MODEL_DTYPE.kv_bytes_per_token(LLAMA_3_8B)
    assert kv16 == 2 * 32 * 8 * 128 * 2
    assert FP8.kv_bytes_per_token(LLAMA_3_8B) * 2 == kv16
    # A decode step dominated by KV reads: only the KV part moves when the weights stay bf16.
    kv_only = Precision.of_run(2, None, "fp8")
    batch, context = 256, 4096
    bf16 = decode_step_roofline(LLAMA_3_8B, batch, context, H200)
    fp8_kv = decode_step_roofline(LLAMA_3_8B, batch, context, H200, kv_only)
    saved = batch * context * kv16 / 2 / H200.bandwidth
    assert bf16 - fp8_kv == pytest.approx(saved, rel=1e-9)


def test_fp8_layer_matmuls_run_at_the_fp8_rate() -> None:
    # A compute-bound prefill: the layers' FLOPs take 1 / speedup of their bf16 time, the LM
    # head's and attention's none.
    n, i, o = 64, 4096, 1
    bf16 = throughput_roofline(LLAMA_3_8B, n, i, o, 64, 8192, H200)
    fp8 = throughput_roofline(LLAMA_3_8B, n, i, o, 64, 8192, H200, FP8)
    layer_s = 2.0 * 32 * LLAMA_3_8B.layer_matmul_params * n * i / H200.matmul_flops
    assert bf16 - fp8 == pytest.approx(layer_s * (1 - 1 / ASSUMED_FP8_MATMUL_SPEEDUP), rel=1e-9)
    measured = Ceilings(4.25e12, 800e12, "test", fp8_matmul_flops=1200e12)
    assert measured.fp8_rate == 1200e12


def test_of_run_and_bad_input() -> None:
    assert Precision.of_run(2, None, "auto") == MODEL_DTYPE
    assert Precision.of_run(4, "fp8", "auto") == Precision(1, 4, 4)
    with pytest.raises(ValueError, match="weight_quantization"):
        Precision.of_run(2, "int8", "auto")
    with pytest.raises(ValueError, match="kv_bytes"):
        Precision(2, 2, 3)


def test_run_precision_reads_the_flag_and_the_checkpoint() -> None:
    plain = SimpleNamespace()
    flagged = EngineConfig(
        model=ModelConfig(quantization="fp8"), cache=CacheConfig(kv_cache_dtype="fp8")
    )
    assert run_precision(flagged, plain, 2) == FP8
    assert run_precision(EngineConfig(), plain, 2) == MODEL_DTYPE
    checkpoint = SimpleNamespace(
        quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"}
    )
    assert run_precision(EngineConfig(), checkpoint, 2) == Precision(1, 2, 2)
