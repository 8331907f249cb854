"""What a started engine holds on its device: KV cache, CUDA-graph memory, free memory.

``benchmarks/startup_check.py`` reports these next to the start-up time; they read the
runner's own accounting, so they live here, beside the engine, and its tests keep them
working when the runner changes.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.entrypoints.llm import LLM
from pagedserve.worker.profile import profile_step, run_profile_step


def memory_report(llm: LLM) -> dict[str, Any]:
    """The KV cache's bytes, the device memory in use before the engine (its process's CUDA
    context; 0 on the CPU) and the CUDA graphs' memory (``graph_report``)."""
    runner = llm.engine_core.model_runner
    return {
        "kv_cache_bytes": sum(t.numel() * t.element_size() for t in runner.kv_caches.values()),
        "memory_baseline_bytes": runner.memory_baseline,
        "graphs": graph_report(llm),
    }


def graph_report(llm: LLM) -> dict[str, Any]:
    """The graph memory the KV budget subtracted (PIECEWISE measured + FULL estimated) next to
    what the captured graphs hold, the captured sizes and the compile's figures; empty for an
    engine without compiled graphs (the CPU, ``enforce_eager``)."""
    runner = llm.engine_core.model_runner
    compiled = runner.compiled_forward
    if compiled is None or not runner.graphs.enabled:
        return {}
    m = runner.graphs.memory
    estimate = None if m.full_estimate is None else (m.piecewise or 0) + m.full_estimate
    actual = None if m.full is None else (m.piecewise or 0) + m.full
    stats = compiled.compile_stats
    return {
        "piecewise_bytes": m.piecewise, "full_estimate_bytes": m.full_estimate,
        "full_bytes": m.full, "estimate_bytes": estimate, "actual_bytes": actual,
        "captured": {k: len(v) for k, v in compiled.captured_sizes().items()},
        "num_compiles": compiled.backend.num_compiles,
        "compile": None if stats is None else {
            "seconds": stats.seconds, "backend_seconds": stats.backend_seconds,
            "pieces": stats.num_pieces, "distinct_pieces": stats.num_distinct_pieces,
            "cache": vars(stats.cache), "cache_dir": str(stats.cache_dir)},
    }  # fmt: skip


def free_at_largest_step(llm: LLM) -> int | None:
    """Free device memory after the engine's largest step (the start-up profile step, run on
    the real cache: the allocator keeps the step's peak reserved). Run it before any request:
    the step needs every request slot. None without a CUDA device, or when the cache is too
    small for the step."""
    if not torch.cuda.is_available():
        return None
    runner = llm.engine_core.model_runner
    step = profile_step(runner.max_num_batched_tokens, runner.max_num_reqs,
                        runner.max_model_len, runner.block_size)
    if step.num_blocks > runner.num_blocks:
        return None
    run_profile_step(runner, step)
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]
