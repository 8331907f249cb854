"""Rooflines: the time a perfect engine would need on this card, from the model shape.

A workload's roofline time is the larger of
    T_compute = (matmul FLOPs + attention FLOPs) / measured bf16 matmul rate
    T_memory  = (bytes that must be read) / measured memory bandwidth
where the bytes are the weights once per forward pass (a decode step reads every weight once,
whatever its batch) plus every KV-cache read (each decode token reads its whole context).

Per token, a dense decoder with L layers, q heads H, kv heads K and head dim d has
    matmul FLOPs = 2 * P_matmul                                  (P_matmul: the weights that
                                                                  multiply it, model/shape.py)
    attention FLOPs at context c = 4 * L * H * d * c             (QK^T and PV)
    KV bytes per cached token = 2 * L * K * d * dtype_bytes
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from pagedserve.model.shape import ModelShape
from pagedserve.platform import Platform, platform_for

# Measured on this project's H200 (see BENCHMARKS.md): device copy (read + write) and an
# 8192^3 bf16 matmul on random data.
MEASURED_CEILINGS = {"H200": (4.25e12, 800e12)}


@dataclass(frozen=True)
class Ceilings:
    bandwidth: float  # bytes/s
    matmul_flops: float  # FLOP/s
    source: str

    def time(self, flops: float, bytes_read: float) -> float:
        return max(flops / self.matmul_flops, bytes_read / self.bandwidth)


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


def decode_step_roofline(shape: ModelShape, batch: int, context: int, ceil: Ceilings) -> float:
    """Seconds for one decode step of ``batch`` requests at ``context`` tokens each."""
    flops = 2.0 * shape.matmul_params * batch + shape.attention_flops(context) * batch
    bytes_read = shape.weight_bytes + batch * context * shape.kv_bytes_per_token
    return ceil.time(flops, bytes_read)


def throughput_roofline(
    shape: ModelShape,
    num_prompts: int,
    input_len: int,
    output_len: int,
    max_batch: int,
    max_batched_tokens: int,
    ceil: Ceilings,
) -> float:
    """Seconds for ``num_prompts`` requests of ``input_len`` in / ``output_len`` out, decoding
    at most ``max_batch`` requests at once (the largest batch the KV cache allows)."""
    n, i, o = num_prompts, input_len, output_len
    decode_tokens_per_req = o - 1  # the first output token comes from the prefill pass
    context_sum = decode_tokens_per_req * i + decode_tokens_per_req * (decode_tokens_per_req + 1) / 2
    flops = 2.0 * shape.matmul_params * n * (i + decode_tokens_per_req)
    flops += n * shape.attention_flops(i * (i + 1) / 2) + n * shape.attention_flops(context_sum)
    decode_steps = math.ceil(n / max(1, max_batch)) * decode_tokens_per_req
    prefill_passes = math.ceil(n * i / max(1, max_batched_tokens))
    bytes_read: float = (decode_steps + prefill_passes) * shape.weight_bytes
    bytes_read += n * (i + context_sum) * shape.kv_bytes_per_token  # prefill writes + decode reads
    return ceil.time(flops, bytes_read)
