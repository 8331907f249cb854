"""Memory profiling: what the device holds besides the KV cache, and so the cache's budget.

On CUDA the KV cache gets what is left of ``gpu_memory_utilization`` x the card once the rest
of the engine at its largest step is counted (``MemoryProfile.kv_budget``):

    gpu_memory_utilization x card memory
      - what the engine holds before the cache (weights, runner buffers, library workspaces,
        loaded kernels: card memory in use now minus what was in use before the engine)
      - peak activations of the largest step
      - CUDA graphs (PIECEWISE measured, FULL estimated; ``CudaGraphManager``)

so that the engine at its largest step uses ``gpu_memory_utilization`` of the card; alone in its
process on an empty card it leaves ``1 - gpu_memory_utilization`` free, less the CUDA context,
which exists before the engine. See docs/architecture.md#kv-cache-and-prefix-caching.

The largest step (``profile_step``) is a plan like any other: ``min(max_num_seqs,
max_num_batched_tokens)`` new requests whose prompts (token 0) add up to the token budget, each
finishing its prefill in this step so every row samples (top-k, top-p and 20 logprobs: the
sampler's most memory-hungry path), then a second plan that finishes them all.

``MemoryProfiler.measure`` runs it through the runner on a temporary KV cache:
1. with torch.compile, one unmeasured run first: it compiles (and Inductor tunes its kernels
   and allocates benchmark buffers, which are no activation memory);
2. the measured run: the allocator's reserved peak above what was reserved before it;
3. the temporary cache is dropped and the card's memory in use is read (less the baseline,
   what was in use before the engine loaded, it is what the engine holds);
4. with CUDA graphs, on a fresh temporary cache: every PIECEWISE graph is captured (and kept:
   they do not involve the KV cache) and the FULL graphs are estimated by a probe
   (``CudaGraphManager.capture_before_kv_cache``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from pagedserve.compilation.phase_log import KV_BUDGET_FIELD, log_phase
from pagedserve.core.sched_output import SchedulerOutput
from pagedserve.math_utils import cdiv
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.dummy_steps import Plans, StepRunner, dummy_plans, run_plans
from pagedserve.worker.kv_cache import used_device_bytes

if TYPE_CHECKING:
    from pagedserve.compilation.compiled_model import CompiledForward
    from pagedserve.worker.cudagraph import CudaGraphManager

logger = logging.getLogger(__name__)
PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=20)
_GIB = 2**30


# ---- the largest step -----------------------------------------------------------------------


@dataclass
class ProfileStep:
    run: SchedulerOutput
    finish: SchedulerOutput
    num_blocks: int
    """Blocks a temporary KV cache needs for ``run`` (block 0 stays the unused null block)."""

    @property
    def plans(self) -> Plans:
        return self.run, self.finish


def profile_step(
    max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int
) -> ProfileStep:
    num_reqs = min(max_num_seqs, max_num_batched_tokens)
    num_tokens = min(max_num_batched_tokens, num_reqs * max_model_len)
    base, extra = divmod(num_tokens, num_reqs)
    lens = [base + (i < extra) for i in range(num_reqs)]
    run, finish = dummy_plans(lens, block_size, PROFILE_SAMPLING, "profile")
    return ProfileStep(run, finish, num_blocks=1 + sum(cdiv(n, block_size) for n in lens))


def run_profile_step(runner: StepRunner, step: ProfileStep) -> None:
    run_plans(runner, step.plans)


# ---- the measurements -----------------------------------------------------------------------


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

    def log_kv_budget(self, gpu_memory_utilization: float) -> int:
        """``kv_budget``, logged with every term (the terms ride along as figures)."""
        budget = self.kv_budget(gpu_memory_utilization)
        logger.info(
            "KV cache budget: %.2f x %.2f GiB - weights %.2f GiB - other %.2f GiB (buffers, "
            "workspaces, kernels) - activations %.2f GiB - CUDA graphs %.2f GiB = %.2f GiB "
            "(%.2f GiB were in use before the engine)", gpu_memory_utilization,
            self.total / _GIB, self.weights / _GIB, (self.engine - self.weights) / _GIB,
            self.activations / _GIB, self.graphs / _GIB, budget / _GIB, self.baseline / _GIB,
            extra={KV_BUDGET_FIELD: {**dataclasses.asdict(self), "budget": budget,
                                     "gpu_memory_utilization": gpu_memory_utilization}},
        )  # fmt: skip
        return budget


class ProfiledRunner(StepRunner, Protocol):
    """What the profiler runs the largest step through, on caches it asks for."""

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def release_kv_cache(self) -> None: ...


@dataclass(frozen=True)
class MemoryProfiler:
    """Measures a ``MemoryProfile`` on CUDA (see the module docstring). ``baseline`` and
    ``weights`` were measured around the weights' load; the rest is measured here on temporary
    caches that are freed again (the PIECEWISE graphs stay)."""

    device: torch.device
    step: ProfileStep
    baseline: int
    """Card memory in use before the engine loaded its weights."""
    weights: int
    """Bytes the weights' load allocated."""

    def measure(self, runner: ProfiledRunner, forward: CompiledForward | None,
                graphs: CudaGraphManager) -> MemoryProfile:
        step = self.step
        runner.initialize_kv_cache(step.num_blocks)
        if forward is not None and forward.compile_stats is None:
            run_profile_step(runner, step)  # compiles; logs its own phase
        activations = self._activation_peak(runner)
        runner.release_kv_cache()
        in_use = used_device_bytes(self.device)
        graph_bytes = 0
        if graphs.enabled:
            runner.initialize_kv_cache(step.num_blocks)
            graph_bytes = graphs.capture_before_kv_cache(runner, forward, step.num_blocks)
            runner.release_kv_cache()
            torch.cuda.empty_cache()
        return MemoryProfile(total=torch.cuda.mem_get_info(self.device)[1],
                             baseline=self.baseline, in_use=in_use, weights=self.weights,
                             activations=activations, graphs=graph_bytes)

    def _activation_peak(self, runner: StepRunner) -> int:
        """Reserved-memory peak of one run of the step above what was reserved before it."""
        device, step = self.device, self.step
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_reserved(device)  # weights, buffers and the temporary cache
        start = time.perf_counter()
        run_profile_step(runner, step)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_reserved(device) - base
        log_phase(logger, "profile step", time.perf_counter() - start,
                  f"{step.run.total_num_scheduled_tokens} tokens, peak {peak / _GIB:.2f} GiB",
                  tokens=step.run.total_num_scheduled_tokens, activation_bytes=peak)
        return peak
