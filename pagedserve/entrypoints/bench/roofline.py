"""Rooflines: the time a perfect engine would need on this card, from the model shape.

A workload's roofline time is the larger of
    T_compute = FP8 matmul FLOPs / FP8 matmul rate
                + (other matmul FLOPs + attention FLOPs) / measured bf16 matmul rate
    T_memory  = (bytes that must be read) / measured memory bandwidth
where the bytes are the weights once per forward pass (a decode step reads every weight once,
whatever its batch) plus every KV-cache read (each decode token reads its whole context).

Per token, a dense decoder with L layers, q heads H, kv heads K and head dim d has
    matmul FLOPs = 2 * P_matmul                                  (P_matmul: the weights that
                                                                  multiply it, model/shape.py)
    attention FLOPs at context c = 4 * L * H * d * c             (QK^T and PV)
    KV bytes per cached token = 2 * L * K * d * kv_bytes

``Precision`` says how many bytes each of those elements takes in a run: FP8 weights are 1 byte
in the decoder layers while the LM head stays in the model's dtype (every FP8 scheme here leaves
it unquantized), and an FP8 KV cache is 1 byte per element. FP8 layers run their matmuls on the
FP8 tensor cores; attention runs in the model's dtype (an FP8 cache is widened in registers).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedserve.config import EngineConfig
from pagedserve.model.quantization import checkpoint_scheme
from pagedserve.model.shape import ModelShape
from pagedserve.platform import platform_for
from pagedserve.platform.base import Platform

# Measured on this project's H200 (see BENCHMARKS.md): device copy (read + write) and an
# 8192^3 bf16 matmul on random data.
MEASURED_CEILINGS = {"H200": (4.25e12, 800e12)}
# FP8 matmul rate over the bf16 one. NVIDIA's H100/H200 SXM
# datasheet gives dense FP8 tensor-core throughput as twice dense bf16, and
# benchmarks/fp8_gemm_sweep.py's square product on an H100 agrees (BENCHMARKS.md, FP8), so the
# FP8 ceiling is the measured bf16 ceiling times 2.
ASSUMED_FP8_MATMUL_SPEEDUP = 2.0


@dataclass(frozen=True)
class Ceilings:
    bandwidth: float  # bytes/s
    matmul_flops: float  # FLOP/s, bf16
    source: str
    fp8_matmul_flops: float | None = None
    """FLOP/s of FP8 matmuls; None: ``matmul_flops * ASSUMED_FP8_MATMUL_SPEEDUP``."""

    @property
    def fp8_rate(self) -> float:
        if self.fp8_matmul_flops is not None:
            return self.fp8_matmul_flops
        return self.matmul_flops * ASSUMED_FP8_MATMUL_SPEEDUP

    def time(self, flops: float, bytes_read: float, fp8_flops: float = 0.0) -> float:
        """``flops`` at the bf16 rate plus ``fp8_flops`` at the FP8 rate, against the bytes."""
        compute = flops / self.matmul_flops + fp8_flops / self.fp8_rate
        return max(compute, bytes_read / self.bandwidth)


@dataclass(frozen=True)
class Precision:
    """Bytes per element of what a forward pass reads (model/shape.py counts the elements)."""

    layer_weight_bytes: int = 2
    """The decoder layers' linear weights: the model's dtype, or 1 for FP8 weights (whose
    matmuls then run at the FP8 rate)."""
    lm_head_bytes: int = 2
    """The LM head: the model's dtype in every scheme (FP8 checkpoints leave it unquantized)."""
    kv_bytes: int = 2
    """One KV-cache element: the model's dtype, or 1 for an FP8 cache."""

    def __post_init__(self) -> None:
        for name in ("layer_weight_bytes", "lm_head_bytes", "kv_bytes"):
            if getattr(self, name) not in (1, 2, 4):
                raise ValueError(f"{name}: must be 1, 2 or 4 bytes, got {getattr(self, name)}")

    @staticmethod
    def of_run(dtype_bytes: int, weight_quantization: str | None, kv_cache_dtype: str) -> Precision:
        """A run's precision: the model's dtype size, its weight quantization (``"fp8"`` or
        None) and its ``kv_cache_dtype`` (``auto`` or an FP8 one)."""
        if weight_quantization not in (None, "fp8"):
            raise ValueError(f"weight_quantization: 'fp8' or None, got {weight_quantization!r}")
        weight_bytes = 1 if weight_quantization == "fp8" else dtype_bytes
        kv = dtype_bytes if kv_cache_dtype == "auto" else 1
        return Precision(weight_bytes, dtype_bytes, kv)

    @property
    def fp8_layers(self) -> bool:
        return self.layer_weight_bytes == 1

    def weight_bytes(self, shape: ModelShape) -> int:
        """Bytes of the weights one forward pass reads: every layer's linears and the LM head."""
        return (
            shape.num_layers * shape.layer_matmul_params * self.layer_weight_bytes
            + shape.vocab * shape.hidden * self.lm_head_bytes
        )

    def kv_bytes_per_token(self, shape: ModelShape) -> int:
        return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * self.kv_bytes

    def matmul_flops(self, shape: ModelShape, tokens: float) -> tuple[float, float]:
        """(bf16-rate FLOPs, FP8-rate FLOPs) of the linear layers for ``tokens`` tokens."""
        layers = 2.0 * shape.num_layers * shape.layer_matmul_params * tokens
        head = 2.0 * shape.vocab * shape.hidden * tokens
        return (head, layers) if self.fp8_layers else (head + layers, 0.0)


MODEL_DTYPE = Precision()
"""Weights, LM head and KV cache all in a 2-byte model dtype (bf16 / fp16)."""


def run_precision(config: EngineConfig, hf_config: Any, dtype_bytes: int) -> Precision:
    """The precision an engine runs at: FP8 layer weights with ``--quantization fp8`` or an FP8
    checkpoint (its ``quantization_config``), an FP8 cache with ``--kv-cache-dtype fp8``."""
    folder = Path(config.model.model)
    scheme = checkpoint_scheme(hf_config, folder if folder.is_dir() else None)
    fp8 = config.model.quantization == "fp8" or scheme is not None
    return Precision.of_run(dtype_bytes, "fp8" if fp8 else None, config.cache.kv_cache_dtype)


def device_ceilings(device: torch.device) -> Ceilings:
    """The card's measured ceilings: from the table for known cards, else measured now."""
    name = platform_for(device).card_name()
    for key, (bw, flops) in MEASURED_CEILINGS.items():
        if name is not None and key in name:
            return Ceilings(bw, flops, f"measured {key} (BENCHMARKS.md)")
    return measure_ceilings(device)


def measure_ceilings(device: torch.device) -> Ceilings:
    """A device copy (bytes read + written) and a bf16 matmul, best of a few runs."""
    platform = platform_for(device)
    n_copy, n_mm = (1 << 28, 8192) if platform.accelerator else (1 << 24, 1024)
    src = torch.randn(n_copy // 4, device=device)
    dst = torch.empty_like(src)
    a = torch.randn(n_mm, n_mm, device=device, dtype=torch.bfloat16)
    b = torch.randn(n_mm, n_mm, device=device, dtype=torch.bfloat16)
    copy_s = _best_time(lambda: dst.copy_(src), platform)
    mm_s = _best_time(lambda: a @ b, platform)
    return Ceilings(2 * n_copy / copy_s, 2 * n_mm**3 / mm_s, f"measured now on {device}")


def _best_time(fn, platform: Platform, repeats: int = 5) -> float:  # noqa: ANN001
    fn()
    best = math.inf
    for _ in range(repeats):
        platform.synchronize()
        start = time.perf_counter()
        fn()
        platform.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def decode_step_roofline(
    shape: ModelShape, batch: int, context: int, ceil: Ceilings,
    precision: Precision = MODEL_DTYPE,
) -> float:  # fmt: skip
    """Seconds for one decode step of ``batch`` requests at ``context`` tokens each."""
    flops, fp8_flops = precision.matmul_flops(shape, batch)
    flops += shape.attention_flops(context) * batch
    kv_read = batch * context * precision.kv_bytes_per_token(shape)
    bytes_read = precision.weight_bytes(shape) + kv_read
    return ceil.time(flops, bytes_read, fp8_flops)


def throughput_roofline(
    shape: ModelShape,
    num_prompts: int,
    input_len: int,
    output_len: int,
    max_batch: int,
    max_batched_tokens: int,
    ceil: Ceilings,
    precision: Precision = MODEL_DTYPE,
) -> float:
    """Seconds for ``num_prompts`` requests of ``input_len`` in / ``output_len`` out, decoding
    at most ``max_batch`` requests at once (the largest batch the KV cache allows)."""
    n, i, o = num_prompts, input_len, output_len
    decode_tokens_per_req = o - 1  # the first output token comes from the prefill pass
    context_sum = (
        decode_tokens_per_req * i + decode_tokens_per_req * (decode_tokens_per_req + 1) / 2
    )
    flops, fp8_flops = precision.matmul_flops(shape, n * (i + decode_tokens_per_req))
    flops += n * shape.attention_flops(i * (i + 1) / 2) + n * shape.attention_flops(context_sum)
    decode_steps = math.ceil(n / max(1, max_batch)) * decode_tokens_per_req
    prefill_passes = math.ceil(n * i / max(1, max_batched_tokens))
    bytes_read: float = (decode_steps + prefill_passes) * precision.weight_bytes(shape)
    # prefill writes + decode reads
    bytes_read += n * (i + context_sum) * precision.kv_bytes_per_token(shape)
    return ceil.time(flops, bytes_read, fp8_flops)
