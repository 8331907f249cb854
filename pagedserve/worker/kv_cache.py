"""How many KV blocks fit, and the cache tensors themselves.

One block holds ``block_size`` tokens of keys and values of every attention layer. The number
of blocks comes from, in order: ``num_gpu_blocks_override``; on the CPU the
``kv_cache_memory`` byte budget (``cpu_kv_budget``); on CUDA the budget the memory profile
leaves (``profile.MemoryProfile.kv_budget``). A budget never yields more blocks than
``max_num_seqs`` full-length requests could use (plus the block pool's null block). See
docs/architecture.md#kv-cache-and-prefix-caching.

On the CPU a context that does not fit the budget is shortened to what fits, with one warning
(``fit_max_model_len``), so that a first run on a small machine works; and the cache's zeros
come from the kernel's zero pages (``Platform.zeros``), so a large budget costs memory
only as requests fill it.

An FP8 cache (``kv_cache_dtype`` fp8) takes one byte per element, so the same budget holds
twice the blocks of a bf16 one.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from pagedserve.attention.backends.base import FP8_KV_DTYPE, UNIT_KV_SCALES
from pagedserve.attention.layer import Attention
from pagedserve.compilation.phase_log import log_phase
from pagedserve.cpu_memory import available_host_bytes
from pagedserve.math_utils import cdiv
from pagedserve.platform import platform_for

logger = logging.getLogger(__name__)

MIN_NUM_BLOCKS = 2
"""The block pool's null block plus at least one usable block."""
_GIB = 2**30
DEFAULT_CPU_KV_CACHE_BYTES = 4 * _GIB
"""vLLM's CPU default: room for the default model's full context many times over."""
CPU_KV_SHARE_OF_AVAILABLE = 0.5
"""The default budget never takes more than this share of the memory available at start-up,
so a small machine keeps room for the rest of its work."""


def cpu_kv_budget(kv_cache_memory: int | None) -> int:
    """The CPU KV cache's byte budget: ``kv_cache_memory`` when set, else 4 GiB or half the
    available memory, whichever is less."""
    if kv_cache_memory is not None:
        return kv_cache_memory
    return min(DEFAULT_CPU_KV_CACHE_BYTES, int(available_host_bytes() * CPU_KV_SHARE_OF_AVAILABLE))


def fit_max_model_len(max_model_len: int, budget_bytes: int, bytes_per_block: int,
                      block_size: int) -> int:
    """``max_model_len``, or the longest context one request can hold in ``budget_bytes``
    (whole blocks, one of them the null block) when that is shorter, with a warning naming the
    options that restore it. ValueError naming ``kv_cache_memory`` when not one block fits."""
    usable_blocks = max(budget_bytes, 0) // bytes_per_block - 1
    fitting = usable_blocks * block_size
    if fitting >= max_model_len:
        return max_model_len
    if usable_blocks < 1:
        raise ValueError(
            f"kv_cache_memory: {budget_bytes / 2**20:.1f} MiB holds no KV block of "
            f"{bytes_per_block / 2**20:.2f} MiB beside the null block; give it more memory"
        )
    logger.warning(
        "max_model_len lowered from %d to %d tokens: that is what one request can hold in the "
        "CPU KV cache's %.2f GiB (set --kv-cache-memory higher, e.g. %.1fGiB, for the full "
        "context, or --max-model-len to choose)", max_model_len, fitting, budget_bytes / _GIB,
        (cdiv(max_model_len, block_size) + 1) * bytes_per_block / _GIB + 0.05)
    return fitting


def log_kv_cache_dtype(layers: dict[str, Attention], dtype: torch.dtype) -> None:
    """For an FP8 cache, one line saying where its scales come from: the checkpoint's
    k_scale / v_scale, or 1.0 for the layers that have none (``model/kv_scales.py``)."""
    if dtype != FP8_KV_DTYPE:
        return
    without = [name for name, layer in layers.items() if layer.kv_scales is UNIT_KV_SCALES]
    if not without:
        logger.info("FP8 KV cache (e4m3): k/v scales from the checkpoint for all %d layers",
                    len(layers))
        return
    logger.info("FP8 KV cache (e4m3): the checkpoint has no k_scale / v_scale for %d of %d "
                "layers; they use 1.0 (values beyond +-448 saturate)", len(without),
                len(layers))


def arm_kv_calibration(layers: dict[str, Attention]) -> None:
    """``calculate_kv_scales``: each layer without checkpoint scales takes its scales from the
    next forward with tokens (``attention/kv_quant.calibrated_kv_scales``); the checkpoint's
    scales are kept where it has them."""
    armed = [layer for layer in layers.values() if layer.kv_scales is UNIT_KV_SCALES]
    for layer in armed:
        layer.calibrate_kv_scales = True
    logger.info("FP8 KV cache (e4m3): k/v scales of %d of %d layers will be calibrated on the "
                "first step with tokens (amax / 448); %d from the checkpoint", len(armed),
                len(layers), len(layers) - len(armed))


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
    platform = platform_for(device)
    caches = {name: platform.zeros(layer.kv_cache_shape(num_blocks, block_size), dtype)
              for name, layer in layers.items()}
    platform.synchronize()  # the zero-fill belongs to the allocation's time
    nbytes = sum(t.numel() * t.element_size() for t in caches.values())
    log_phase(logger, "allocate KV cache", time.perf_counter() - start,
              f"{num_blocks} blocks, {nbytes / _GIB:.2f} GiB", num_blocks=num_blocks,
              bytes=nbytes)
    return caches
