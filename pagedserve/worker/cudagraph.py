"""The runner's CUDA graphs: capture sizes, which graph serves a batch, and start-up capture.

``CudaGraphManager`` is the one owner: the capture ladders, the sizes captured per mode, the
graph memory pool, the start-up captures and the memory they hold, and, each step, the
descriptor and execution mode of the batch. The compiler backend (``compilation/``) splits the
model and wraps each piece (and the whole forward) in a ``CUDAGraphWrapper``; the manager
decides when those wrappers capture and replay. See docs/architecture.md#cuda-graphs.

Dispatch. The runner asks before it builds any input, because the answer sets the padded token
count (and, for FULL graphs, the padded request count) of every buffer view of the step. Each
mode pads on its own ladder of capture sizes (``CaptureLadders``): FULL on a dense one (a decode
step is short, padding it costs a larger share), PIECEWISE on a sparse one (each size is one
graph per compiled piece, and a mixed batch's GEMMs are weight-read bound, so padding it costs
little).
- A uniform decode batch (every request runs exactly 1 token) within the FULL ladder: FULL,
  the graph of the whole forward, padded to the next FULL size in tokens *and* requests.
- Anything else within the PIECEWISE ladder: PIECEWISE, the compiled pieces between attention
  ops, padded to the next PIECEWISE size in tokens only.
- Above the PIECEWISE ladder, a step of exactly an *exact* size (``CaptureLadders.exact``: the
  token budget, where ``wants_budget_graph``): PIECEWISE, unpadded. Nothing pads into an exact
  size: above the ladder a step's GEMMs are compute-bound, so padding costs its share of GPU
  time, while the steps of a prompt burst fill the budget exactly.
- Anything else, or with ``enforce_eager``: NONE (eager, no padding).
A descriptor's graph runs only once it is captured (or while it is being captured); until then
the step runs eagerly, padded as the descriptor says (``CudaGraphManager.execution_mode``).

Capture. Each capture runs a dummy plan exactly like a real step (same buffers, same input
prep, same metadata), so a replay later reads the very addresses the capture recorded:
- FULL: ``size`` new requests with a one-token prompt each (a uniform decode batch), for each
  size of the FULL ladder;
- PIECEWISE: new requests whose prompts make ``size`` tokens (a prefill batch), for each size of
  the PIECEWISE ladder and its exact sizes; each size costs one graph per compiled piece, so
  this ladder sets most of the capture time.
Sizes go from the largest down, so smaller captures reuse the pool memory of larger ones, and
every capture phase runs on the pool's side stream (``GraphPool.capture_phase``).

Warm-ups (an eager run of the same plan before capturing) exist so that nothing lazy happens
inside a capture: Triton JIT compiles, cuBLAS workspace allocation.
- PIECEWISE graphs hold compiled pieces only. Their kernels were compiled and tuned once for
  the symbolic size by the first (profile) run, and attention runs eagerly between the pieces,
  outside any graph. One warm-up on the capture stream (its cuBLAS workspace) serves every size.
- FULL graphs hold the Triton kernels (attention, input prep), whose JIT specializations depend
  on integer arguments (request counts divisible by 16, equal to 1, ...), so a size may need a
  kernel no earlier run compiled. A Triton compile and module load inside a capture is allowed
  (host work; nothing is recorded), so only the largest FULL size gets a warm-up (cuBLAS at
  decode shapes) and the others none.

Memory. PIECEWISE graphs do not touch the KV cache (attention runs outside them), so
``capture_before_kv_cache`` captures all of them during memory profiling, on the temporary
cache, and measures exactly what they hold. FULL graphs bake the KV cache's address in, so they
are captured after the cache exists (``capture``); before it, a probe captures the two largest
FULL sizes, measures them and drops them: the first holds the FULL graphs' extra pool memory,
the second the per-graph memory (driver-side graph state), and the estimate is
first + (n - 1) x second. The pool blocks the probe leaves behind stay in the pool, and the real
FULL captures reuse them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedserve.compilation.cuda_graph import GraphPool
from pagedserve.compilation.phase_log import log_phase
from pagedserve.config import EngineConfig
from pagedserve.math_utils import cdiv
from pagedserve.model.shape import ModelShape
from pagedserve.platform import platform_for
from pagedserve.worker.capture_sizes import (
    DECODE_QUERY_LEN,
    BatchDescriptor,
    CudaGraphMode,
    capture_ladders,
    describe_batch,
    full_sizes,
    piecewise_sizes,
    prompt_lens,
)
from pagedserve.worker.dummy_steps import (
    GREEDY_ONE_TOKEN,
    Plans,
    StepRunner,
    dummy_plans,
    run_plans,
    verify_plans,
)
from pagedserve.worker.kv_cache import used_device_bytes

if TYPE_CHECKING:
    from pagedserve.compilation.compiled_model import CompiledForward
    from pagedserve.worker.input_batch import BatchPlan

logger = logging.getLogger(__name__)
_GIB = 2**30


def full_graph_estimate(samples: list[int], num_graphs: int) -> int:
    """FULL graphs' memory from the probe: ``samples[0]`` (the largest size's capture: its pool
    growth and its own graph) plus ``num_graphs - 1`` times ``samples[1]`` (one more graph);
    negative samples (the driver gave pages back) count as 0."""
    if num_graphs == 0 or not samples:
        return 0
    per_graph = max(samples[1], 0) if len(samples) > 1 else 0
    return max(samples[0], 0) + per_graph * (num_graphs - 1)


# ---- the manager ----------------------------------------------------------------------------


@dataclass
class GraphMemory:
    """Device memory (bytes) the graphs hold, as start-up measured it; None where that step
    did not run."""

    piecewise: int | None = None
    """Measured around the PIECEWISE capture."""
    full_estimate: int | None = None
    """FULL graphs, estimated by the probe before the KV cache is sized."""
    full_probe_kept: int = 0
    """What the probe's dropped graphs left in the pool (reused by the real FULL capture)."""
    full: int | None = None
    """FULL graphs, measured around the real capture, plus ``full_probe_kept``."""


class CudaGraphManager:
    """The runner's CUDA graphs (see the module docstring): built once the model's shape is
    known, since the shape decides an unset ``budget_step_graph``.

    ``pool`` is None where graphs are off (the CPU, ``enforce_eager``, compile mode ``none``):
    nothing is captured then, and every batch runs eagerly, padded as its descriptor says."""

    def __init__(self, config: EngineConfig, shape: ModelShape, max_model_len: int,
                 device: torch.device) -> None:
        self.ladders = capture_ladders(config, shape)
        self.enforce_eager = config.compilation.enforce_eager
        self.device = device
        self.block_size = config.cache.block_size
        self.max_num_reqs = config.scheduler.max_num_seqs
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.max_model_len = max_model_len
        graphs = config.compilation.uses_cuda_graphs(platform_for(device))
        self.pool = GraphPool() if graphs else None
        """Shared by every graph of the model; the compiled forward's wrappers capture into
        it."""
        self.memory = GraphMemory()
        self.captured: dict[CudaGraphMode, set[int]] = {
            CudaGraphMode.FULL: set(), CudaGraphMode.PIECEWISE: set()}
        self.captured_verify: set[int] = set()
        """FULL sizes of verify batches (graphs of their own: a size may be in both)."""
        self.capturing: CudaGraphMode | None = None
        """The mode being captured right now (start-up only)."""

    @property
    def enabled(self) -> bool:
        """Whether graphs are captured at all (a pool exists)."""
        return self.pool is not None

    # ---- each step ----------------------------------------------------------------------

    def dispatch(self, plan: BatchPlan) -> tuple[BatchDescriptor, CudaGraphMode]:
        """The batch's descriptor (how far it pads) and its execution mode (how it runs)."""
        descriptor = describe_batch(plan.num_reqs, plan.num_tokens, plan.uniform_decode_len,
                                    self.ladders, self.enforce_eager)
        return descriptor, self.execution_mode(descriptor)

    def execution_mode(self, descriptor: BatchDescriptor) -> CudaGraphMode:
        """The descriptor's mode if its graph was captured (or is being captured now), else
        NONE: eager, with the tokens still padded as the descriptor says."""
        mode = descriptor.mode
        if mode is CudaGraphMode.NONE:
            return mode
        captured = self.captured[mode]
        if mode is CudaGraphMode.FULL and descriptor.query_len > DECODE_QUERY_LEN:
            captured = self.captured_verify
        if self.capturing is mode or descriptor.num_tokens in captured:
            return mode
        return CudaGraphMode.NONE

    def captured_sizes(self) -> dict[str, list[int]]:
        """Captured sizes per mode name, largest first."""
        sizes = {mode.name: sorted(self.captured[mode], reverse=True)
                 for mode in (CudaGraphMode.FULL, CudaGraphMode.PIECEWISE)}
        if self.captured_verify:
            sizes["FULL_VERIFY"] = sorted(self.captured_verify, reverse=True)
        return sizes

    # ---- start-up -----------------------------------------------------------------------

    def capture_before_kv_cache(self, runner: StepRunner, forward: CompiledForward | None,
                                num_blocks: int) -> int:
        """During memory profiling, on a temporary cache of ``num_blocks`` blocks: every
        PIECEWISE graph (kept) and the FULL probe. Returns the graph memory the KV budget must
        leave: PIECEWISE measured + FULL estimated."""
        self._capture_piecewise(runner, forward, num_blocks)
        piecewise = max(self.memory.piecewise or 0, 0)  # < 0: the driver gave pages back
        return piecewise + self._probe_full(runner, forward, num_blocks)

    def capture(self, runner: StepRunner, forward: CompiledForward | None,
                num_blocks: int) -> dict[str, list[int]]:
        """After the KV cache of ``num_blocks`` blocks exists: the PIECEWISE sizes if profiling
        did not capture them (a fixed block count skips profiling), then every FULL size.
        Returns the captured sizes ({} where graphs are off)."""
        if self.pool is None:
            return {}
        if not self.captured[CudaGraphMode.PIECEWISE]:
            self._capture_piecewise(runner, forward, num_blocks)
        self._capture_full(runner, forward, num_blocks)
        return self.captured_sizes()

    def _capture_full(self, runner: StepRunner, forward: CompiledForward | None,
                      num_blocks: int) -> None:
        """Capture every FULL size after one warm-up (the largest); records their memory."""
        pool, _ = self._require_graphs(forward)
        device = self.device
        sizes = self._full_sizes(num_blocks)
        start, before = time.perf_counter(), used_device_bytes(device)
        with pool.capture_phase(device):
            if sizes:
                run_plans(runner, self._full_plans(sizes[0]))  # the phase's one warm-up
            for size in sizes:
                self._capture_one(runner, CudaGraphMode.FULL, size, self._full_plans(size))
            for size in self._verify_sizes(num_blocks):
                self._capture_one(runner, CudaGraphMode.FULL, size, self._verify_plans(size),
                                  self.captured_verify)
        memory = self.memory
        memory.full = used_device_bytes(device) - before + memory.full_probe_kept
        actual = (memory.piecewise or 0) + memory.full
        estimate = "" if memory.full_estimate is None else (
            f" (the KV budget left {((memory.piecewise or 0) + memory.full_estimate) / _GIB:.3f}"
            f" GiB: FULL estimated at {memory.full_estimate / _GIB:.3f} GiB)")
        log_phase(logger, "capture FULL", time.perf_counter() - start,
                  f"{len(sizes)} graphs, {memory.full / _GIB:.3f} GiB; all graphs "
                  f"{actual / _GIB:.3f} GiB{estimate}",
                  graphs=len(sizes), bytes=memory.full, estimate_bytes=memory.full_estimate,
                  all_graphs_bytes=actual)

    def _capture_piecewise(self, runner: StepRunner, forward: CompiledForward | None,
                           num_blocks: int) -> list[int]:
        """Capture every PIECEWISE size after one warm-up; records the memory they hold."""
        pool, forward = self._require_graphs(forward)
        device, bs, ladders = self.device, self.block_size, self.ladders
        sizes = piecewise_sizes(ladders.piecewise + ladders.exact, self.max_num_batched_tokens,
                                self.max_num_reqs, self.max_model_len, num_blocks - 1, bs)
        plans = {size: dummy_plans(prompt_lens(size, self.max_model_len, bs), bs, GREEDY_ONE_TOKEN,
                                   "capture") for size in sizes}
        start, before = time.perf_counter(), used_device_bytes(device)
        with pool.capture_phase(device):
            if sizes:
                run_plans(runner, plans[sizes[0]])  # the one warm-up, on the capture stream
            for size in sizes:
                self._capture_one(runner, CudaGraphMode.PIECEWISE, size, plans[size])
        self.memory.piecewise = used_device_bytes(device) - before
        num_graphs = len(sizes) * len(forward.piecewise_wrappers)
        log_phase(logger, "capture PIECEWISE", time.perf_counter() - start,
                  f"{len(sizes)} sizes, {num_graphs} graphs, "
                  f"{self.memory.piecewise / _GIB:.3f} GiB",
                  sizes=len(sizes), graphs=num_graphs, bytes=self.memory.piecewise)
        return sizes

    def _probe_full(self, runner: StepRunner, forward: CompiledForward | None,
                    num_blocks: int) -> int:
        """Estimate the FULL graphs' memory on the current (temporary) cache; drops the probe's
        graphs again (their pool blocks stay for the real captures) and returns the estimate."""
        pool, forward = self._require_graphs(forward)
        device = self.device
        sizes = self._full_sizes(num_blocks)
        start, before = time.perf_counter(), used_device_bytes(device)
        samples = []
        with pool.capture_phase(device):
            for i, size in enumerate(sizes[:2]):
                size_before = used_device_bytes(device)
                if i == 0:
                    run_plans(runner, self._full_plans(size))  # the phase's one warm-up
                self._capture_one(runner, CudaGraphMode.FULL, size, self._full_plans(size))
                samples.append(used_device_bytes(device) - size_before)
        for size in sizes[:2]:
            if forward.full_graph is not None:
                forward.full_graph.drop(size)
            self.captured[CudaGraphMode.FULL].discard(size)
        memory = self.memory
        memory.full_estimate = full_graph_estimate(samples, len(sizes))
        memory.full_probe_kept = used_device_bytes(device) - before
        log_phase(logger, "probe FULL", time.perf_counter() - start,
                  f"{len(sizes)} sizes, estimate {memory.full_estimate / _GIB:.3f} GiB from "
                  f"samples {[round(s / 2**20, 1) for s in samples]} MiB",
                  sizes=len(sizes), estimate_bytes=memory.full_estimate)
        return memory.full_estimate

    def _capture_one(self, runner: StepRunner, mode: CudaGraphMode, size: int,
                     plans: Plans, captured: set[int] | None = None) -> None:
        """Run ``plans`` with ``mode`` being captured: its wrappers capture ``size``, which
        joins ``captured`` (default: the mode's sizes)."""
        self.capturing = mode
        try:
            run_plans(runner, plans)
        finally:
            self.capturing = None
        (self.captured[mode] if captured is None else captured).add(size)

    def _full_sizes(self, num_blocks: int) -> list[int]:
        return full_sizes(self.ladders.full, self.max_num_reqs, self.max_num_batched_tokens,
                          num_blocks - 1)

    def _full_plans(self, size: int) -> Plans:
        return dummy_plans([DECODE_QUERY_LEN] * size, self.block_size, GREEDY_ONE_TOKEN, "capture")

    def _verify_sizes(self, num_blocks: int) -> list[int]:
        """Verify sizes whose requests fit the slots and the blocks, largest first (a size
        already captured, e.g. by an earlier call, is kept)."""
        q = self.ladders.verify_query_len
        blocks_per_req = cdiv(1 + q, self.block_size)
        return sorted((s for s in self.ladders.verify
                       if s // q <= self.max_num_reqs
                       and s // q * blocks_per_req <= num_blocks - 1
                       and s not in self.captured_verify), reverse=True)

    def _verify_plans(self, size: int) -> Plans:
        """``size // q`` requests that each verify q - 1 drafts after one computed token."""
        q = self.ladders.verify_query_len
        return verify_plans(size // q, q, self.block_size)

    def _require_graphs(self, forward: CompiledForward | None
                        ) -> tuple[GraphPool, CompiledForward]:
        if self.pool is None or forward is None:
            raise ValueError("graph capture: graphs are off, or the runner has no compiled "
                             "forward")
        return self.pool, forward
