"""How many KV blocks fit, and the cache tensors themselves.

One block holds ``block_size`` tokens of keys and values of every attention layer. The number
of blocks comes from, in order: ``num_gpu_blocks_override``; on the CPU the
``kv_cache_memory`` byte budget; on CUDA the budget of a ``MemoryProfile`` (profile.py):

    gpu_memory_utilization x card memory
      - what the engine holds before the cache (weights, runner buffers, library workspaces,
        loaded kernels: card memory in use now minus what was in use before the engine)
      - peak activations of the largest step
      - CUDA graphs (PIECEWISE measured, FULL estimated; graph_capture.py)

so that the engine at its largest step uses ``gpu_memory_utilization`` of the card; alone in
its process on an empty card it leaves ``1 - gpu_memory_utilization`` free, less the CUDA
context, which exists before the engine.
A budget never yields more blocks than ``max_num_seqs`` full-length requests could use (plus
the block pool's null block).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass

import torch

from pagedserve.attention.layer import Attention
from pagedserve.compilation.phase_log import KV_BUDGET_FIELD, log_phase
from pagedserve.math_utils import cdiv

logger = logging.getLogger(__name__)

MIN_NUM_BLOCKS = 2
"""The block pool's null block plus at least one usable block."""
_GIB = 2**30


def kv_bytes_per_block(layers: dict[str, Attention], block_size: int, dtype: torch.dtype) -> int:
    elem_size = torch.empty((), dtype=dtype).element_size()
    per_layer = [math.prod(layer.kv_cache_shape(1, block_size)) for layer in layers.values()]
    return sum(per_layer) * elem_size


def max_useful_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    return max_num_seqs * cdiv(max_model_len, block_size) + 1


def num_blocks_from_budget(budget_bytes: int, bytes_per_block: int, max_blocks: int) -> int:
    """Blocks that fit in ``budget_bytes``, at most ``max_blocks``; ValueError below two."""
    num_blocks = min(max(budget_bytes, 0) // bytes_per_block, max_blocks)
    if num_blocks < MIN_NUM_BLOCKS:
        raise ValueError(
            f"KV cache: a budget of {budget_bytes / 2**20:.1f} MiB holds {num_blocks} blocks of "
            f"{bytes_per_block / 2**20:.2f} MiB, at least {MIN_NUM_BLOCKS} are needed (raise "
            "kv_cache_memory / gpu_memory_utilization, or lower max_num_batched_tokens)"
        )
    capped = " (capped: max_num_seqs full-length requests)" if num_blocks == max_blocks else ""
    logger.info("KV cache: %d blocks x %.3f MiB = %.2f GiB of a %.2f GiB budget%s", num_blocks,
                bytes_per_block / 2**20, num_blocks * bytes_per_block / _GIB,
                budget_bytes / _GIB, capped)
    return num_blocks


@dataclass(frozen=True)
class MemoryProfile:
    """Device memory besides the KV cache, measured at start-up (bytes)."""

    total: int
    """The card's memory."""
    baseline: int
    """In use on the card before the engine loaded its weights: this process's CUDA context,
    other engines and processes. Not the engine's: ``gpu_memory_utilization`` is the share of
    the card the engine itself may use (vLLM's per-instance meaning)."""
    in_use: int
    """In use on the card before the KV cache and the graphs: the baseline plus the engine's
    weights, runner buffers, library workspaces and loaded kernels."""
    weights: int
    """The model's weights (part of ``in_use``; for the log)."""
    activations: int
    """Peak the largest step reserves beyond ``in_use`` (allocator segments, not tensors:
    that is what stays unavailable to others)."""
    graphs: int
    """CUDA graphs: PIECEWISE measured, FULL estimated."""

    def __post_init__(self) -> None:
        for name in ("total", "baseline", "in_use", "weights", "activations", "graphs"):
            if getattr(self, name) < 0:
                raise ValueError(f"MemoryProfile.{name}: negative ({getattr(self, name)})")
        for name in ("baseline", "in_use"):
            if getattr(self, name) > self.total:
                raise ValueError(f"MemoryProfile.{name}: {getattr(self, name)} exceeds the card "
                                 f"({self.total})")

    @property
    def engine(self) -> int:
        """What the engine holds before its KV cache and graphs: the growth since the
        baseline, and at least the weights (another process may have freed memory since)."""
        return max(self.in_use - self.baseline, self.weights)

    def kv_budget(self, gpu_memory_utilization: float) -> int:
        """``gpu_memory_utilization x total - engine - activations - graphs`` (may be < 0)."""
        allowed = int(gpu_memory_utilization * self.total)
        return allowed - self.engine - self.activations - self.graphs


def cuda_kv_budget(profile: MemoryProfile, gpu_memory_utilization: float) -> int:
    """The KV cache's byte budget; logs every term."""
    budget = profile.kv_budget(gpu_memory_utilization)
    logger.info(
        "KV cache budget: %.2f x %.2f GiB - weights %.2f GiB - other %.2f GiB (buffers, "
        "workspaces, kernels) - activations %.2f GiB - CUDA graphs %.2f GiB = %.2f GiB (%.2f "
        "GiB were in use before the engine)", gpu_memory_utilization, profile.total / _GIB,
        profile.weights / _GIB, (profile.engine - profile.weights) / _GIB,
        profile.activations / _GIB, profile.graphs / _GIB, budget / _GIB,
        profile.baseline / _GIB,
        extra={KV_BUDGET_FIELD: {**dataclasses.asdict(profile), "budget": budget,
                                 "gpu_memory_utilization": gpu_memory_utilization}},
    )  # fmt: skip
    return budget


def used_device_bytes(device: torch.device) -> int:
    """Memory in use on the card (every process), after this process's allocator gave its
    unused cached blocks back; CUDA only."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def allocate_kv_caches(
    layers: dict[str, Attention],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """layer name -> [2, num_blocks, block_size, num_kv_heads, head_dim], zero-filled."""
    start = time.perf_counter()
    caches = {
        name: torch.zeros(layer.kv_cache_shape(num_blocks, block_size), dtype=dtype,
                          device=device)
        for name, layer in layers.items()
    }
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the zero-fill belongs to the allocation's time
    nbytes = sum(t.numel() * t.element_size() for t in caches.values())
    log_phase(logger, "allocate KV cache", time.perf_counter() - start,
              f"{num_blocks} blocks, {nbytes / _GIB:.2f} GiB", num_blocks=num_blocks,
              bytes=nbytes)
    return caches
