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

import bisect
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from pagedserve.compilation.cuda_graph import GraphPool
from pagedserve.compilation.phase_log import log_phase
from pagedserve.config import EngineConfig
from pagedserve.core.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedserve.math_utils import cdiv
from pagedserve.model.shape import ModelShape
from pagedserve.platform import platform_for
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.kv_cache import used_device_bytes

if TYPE_CHECKING:
    from pagedserve.compilation.compiled_model import CompiledForward
    from pagedserve.worker.input_batch import BatchPlan

logger = logging.getLogger(__name__)
_GIB = 2**30

DECODE_QUERY_LEN = 1
"""Tokens a decode step runs per request (no speculative decoding)."""


class CudaGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2


@dataclass(frozen=True)
class BatchDescriptor:
    mode: CudaGraphMode
    num_tokens: int
    """Token count after padding (the capture size of the graph, or the real count for NONE)."""
    num_reqs: int | None
    """Request count after padding; None when requests are not padded (PIECEWISE, NONE)."""

    @property
    def query_len(self) -> int:
        """Tokens per request of a FULL graph: 1, or 1 + k when it verifies k drafts each."""
        return 1 if self.num_reqs is None else self.num_tokens // self.num_reqs


# ---- capture sizes --------------------------------------------------------------------------


def padded_size(n: int, capture_sizes: list[int]) -> int:
    """The smallest capture size >= n, or n itself above the largest one."""
    i = bisect.bisect_left(capture_sizes, n)
    return capture_sizes[i] if i < len(capture_sizes) else n


@dataclass(frozen=True)
class CaptureLadders:
    """The capture sizes of each graph mode, each sorted ascending (``CompilationConfig``'s
    ``full_capture_sizes`` and ``piecewise_capture_sizes``)."""

    full: list[int]
    piecewise: list[int]
    exact: list[int] = field(default_factory=list)
    """PIECEWISE sizes above the ladder that only a step of exactly that many tokens replays."""
    verify: list[int] = field(default_factory=list)
    """FULL sizes (tokens) of verify batches: ``verify_query_len`` tokens per request."""
    verify_query_len: int = 0
    """1 + k with speculative decoding (k drafts per request), else 0: no verify graphs."""

    def __post_init__(self) -> None:
        for name in ("full", "piecewise", "exact", "verify"):
            sizes = getattr(self, name)
            if sizes != sorted(set(sizes)):
                raise ValueError(f"CaptureLadders.{name}: not ascending and distinct: {sizes}")
        if self.exact and self.piecewise and self.exact[0] <= self.piecewise[-1]:
            raise ValueError(f"CaptureLadders.exact: {self.exact} must lie above the PIECEWISE "
                             f"ladder (up to {self.piecewise[-1]})")

    def ladder(self, mode: CudaGraphMode) -> list[int]:
        """The sizes ``mode`` pads on (NONE: the PIECEWISE ladder, the one every batch that is
        not a FULL decode is measured against)."""
        return self.full if mode is CudaGraphMode.FULL else self.piecewise

    def max_padded_tokens(self, max_num_tokens: int) -> int:
        """The most tokens any batch of at most ``max_num_tokens`` pads to, on either ladder:
        what token buffers must hold."""
        return max(padded_size(max_num_tokens, self.full),
                   padded_size(max_num_tokens, self.piecewise))

    def max_padded_reqs(self, max_num_reqs: int) -> int:
        """The most requests any batch of at most ``max_num_reqs`` pads to: only FULL pads
        requests (to its token size, one token per request)."""
        return padded_size(max_num_reqs, self.full)


# Linear-layer FLOPs per decoder layer of a full-budget step up to which the budget-step graph
# is captured by default: between Qwen3-0.6B at 8,192 tokens (0.26 TFLOP per layer, a step
# bound by the host launching its kernels) and Llama-3-8B (3.6 TFLOP, bound by the GPU). Below
# it the graph's activations are small too (they grow with the same widths).
HOST_BOUND_LAYER_FLOPS = 0.5e12


def wants_budget_graph(config: EngineConfig, shape: ModelShape | None) -> bool:
    """``budget_step_graph`` as set, or, unset, whether a full-budget step of ``shape`` is
    small enough to be host-bound (no shape: not decided, no graph). Under tensor
    parallelism each rank's host launches every kernel for its share of the FLOPs."""
    asked = config.compilation.budget_step_graph
    if asked is not None:
        return asked
    if shape is None:
        return False
    budget = config.scheduler.max_num_batched_tokens
    rank_flops = 2 * budget * shape.layer_matmul_params / config.parallel.tensor_parallel_size
    return rank_flops <= HOST_BOUND_LAYER_FLOPS


def capture_ladders(config: EngineConfig, shape: ModelShape | None = None) -> CaptureLadders:
    """The configured ladders, and the token budget as an exact PIECEWISE size where
    ``wants_budget_graph`` and the ladder stops below the budget."""
    compilation = config.compilation
    full, piecewise = compilation.full_capture_sizes, compilation.piecewise_capture_sizes
    budget = config.scheduler.max_num_batched_tokens
    above_ladder = not piecewise or budget > piecewise[-1]
    exact = [budget] if above_ladder and wants_budget_graph(config, shape) else []
    return CaptureLadders(full, piecewise, exact, *verify_ladder(config, full))


def verify_ladder(config: EngineConfig, full: list[int]) -> tuple[list[int], int]:
    """FULL sizes of batches where every request verifies k drafts (query length 1 + k): the
    FULL ladder's request counts up to ``disable_by_batch_size`` (no drafts above it) times
    1 + k, within the token budget; ([], 0) without speculative decoding."""
    spec = config.scheduler.speculative_config
    if spec is None:
        return [], 0
    query_len = 1 + spec.num_speculative_tokens
    budget = config.scheduler.max_num_batched_tokens
    sizes = [r * query_len for r in full
             if r <= spec.disable_by_batch_size and r * query_len <= budget]
    return sizes, query_len


def padded_buffer_sizes(config: EngineConfig) -> tuple[int, int]:
    """(tokens, requests) the persistent input buffers must hold: the most any step pads to.

    The model's shape plays no part, so the runner sizes its buffers before the model loads:
    the shape only decides the exact sizes, and an exact size is the token budget itself, which
    no ladder pads below."""
    ladders = capture_ladders(config)
    return (ladders.max_padded_tokens(config.scheduler.max_num_batched_tokens),
            ladders.max_padded_reqs(config.scheduler.max_num_seqs))


def describe_batch(
    num_reqs: int,
    num_tokens: int,
    uniform_decode_len: int | None,
    ladders: CaptureLadders,
    enforce_eager: bool,
) -> BatchDescriptor:
    """The descriptor of a batch of ``num_reqs`` requests and ``num_tokens`` tokens.

    ``uniform_decode_len``: the common query length when every request is decoding (None when
    the batch has a real prefill). A uniform decode batch above the FULL ladder falls to
    PIECEWISE if its ladder reaches further (only with explicit sizes; the defaults end at the
    same size).
    """
    if num_reqs <= 0 or num_tokens < num_reqs:
        raise ValueError(f"dispatch: {num_reqs} requests with {num_tokens} tokens")
    if enforce_eager:
        return BatchDescriptor(CudaGraphMode.NONE, num_tokens, None)
    full, piecewise = ladders.full, ladders.piecewise
    if uniform_decode_len == DECODE_QUERY_LEN and full and num_tokens <= full[-1]:
        # num_tokens == num_reqs here, so the request count pads to the same size.
        size = padded_size(num_tokens, full)
        return BatchDescriptor(CudaGraphMode.FULL, size, size)
    q, verify = ladders.verify_query_len, ladders.verify
    if uniform_decode_len == q and verify and num_tokens <= verify[-1]:
        size = padded_size(num_tokens, verify)  # a multiple of q: requests pad alike
        return BatchDescriptor(CudaGraphMode.FULL, size, size // q)
    if piecewise and num_tokens <= piecewise[-1]:
        return BatchDescriptor(CudaGraphMode.PIECEWISE, padded_size(num_tokens, piecewise), None)
    if num_tokens in ladders.exact:
        return BatchDescriptor(CudaGraphMode.PIECEWISE, num_tokens, None)
    return BatchDescriptor(CudaGraphMode.NONE, num_tokens, None)


def full_sizes(capture_sizes: list[int], max_num_reqs: int, max_num_batched_tokens: int,
               usable_blocks: int) -> list[int]:
    """FULL capture sizes (of the FULL ladder), largest first: ``size`` one-token requests
    need ``size`` request slots, tokens and blocks."""
    limit = min(max_num_reqs, max_num_batched_tokens, usable_blocks)
    return sorted((s for s in capture_sizes if s <= limit), reverse=True)


def piecewise_sizes(capture_sizes: list[int], max_num_batched_tokens: int, max_num_reqs: int,
                    max_model_len: int, usable_blocks: int, block_size: int) -> list[int]:
    """PIECEWISE capture sizes (of the PIECEWISE ladder and its exact sizes), largest first: a
    size's prompts (``prompt_lens``) must fit the token budget, the request slots and the
    blocks, as a real step's must. Size 1 is left out: a one-token step is a decode (FULL)
    unless it is a one-token prefill."""
    most_tokens = max_num_reqs * _longest_prompt(max_model_len, block_size)
    limit = min(max_num_batched_tokens, most_tokens, usable_blocks * block_size)
    return sorted((s for s in capture_sizes if 2 <= s <= limit), reverse=True)


def prompt_lens(size: int, max_model_len: int, block_size: int) -> list[int]:
    """Prompts of at most ``max_model_len`` tokens (whole blocks but the last) that make
    ``size`` tokens: a PIECEWISE graph depends on the step's token count only (attention, where
    the requests show, runs between the pieces), so a size above the context still has one."""
    longest = _longest_prompt(max_model_len, block_size)
    return [longest] * (size // longest) + ([size % longest] if size % longest else [])


def _longest_prompt(max_model_len: int, block_size: int) -> int:
    """The context rounded down to whole blocks (the context itself if under one block)."""
    return max_model_len // block_size * block_size or max_model_len


def full_graph_estimate(samples: list[int], num_graphs: int) -> int:
    """FULL graphs' memory from the probe: ``samples[0]`` (the largest size's capture: its pool
    growth and its own graph) plus ``num_graphs - 1`` times ``samples[1]`` (one more graph);
    negative samples (the driver gave pages back) count as 0."""
    if num_graphs == 0 or not samples:
        return 0
    per_graph = max(samples[1], 0) if len(samples) > 1 else 0
    return max(samples[0], 0) + per_graph * (num_graphs - 1)


# ---- the dummy steps that captures (and the memory profile) run ----------------------------

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
Plans = tuple[SchedulerOutput, SchedulerOutput]
"""A step's plan and the plan that frees its requests again."""


def dummy_plans(prompt_lens: list[int], block_size: int, sampling_params: SamplingParams,
                name: str) -> Plans:
    """A step of new requests ``{name}-{i}`` with prompts of token 0 of these lengths, each
    finishing its prefill in the step (blocks from 1 up: block 0 is the null block), and the
    plan that frees them again."""
    new_reqs, num_scheduled, next_block = [], {}, 1
    for i, n in enumerate(prompt_lens):
        req_id = f"{name}-{i}"
        blocks = cdiv(n, block_size)
        new_reqs.append(NewRequestData(
            req_id=req_id, prefill_token_ids=[0] * n, num_prompt_tokens=n,
            sampling_params=sampling_params,
            block_ids=(list(range(next_block, next_block + blocks)),), num_computed_tokens=0,
        ))  # fmt: skip
        num_scheduled[req_id] = n
        next_block += blocks
    run = SchedulerOutput(new_reqs, CachedRequestData(), num_scheduled, sum(prompt_lens), set())
    finish = SchedulerOutput([], CachedRequestData(), {}, 0, set(num_scheduled))
    return run, finish


def verify_plans(num_reqs: int, query_len: int, block_size: int) -> Plans:
    """A step of ``num_reqs`` requests past a one-token prompt, each verifying
    ``query_len - 1`` drafts (token 0), and the plan that frees them again."""
    blocks = cdiv(1 + query_len, block_size)
    new_reqs, num_scheduled, drafts = [], {}, {}
    for i in range(num_reqs):
        req_id = f"verify-{i}"
        new_reqs.append(NewRequestData(
            req_id=req_id, prefill_token_ids=[0], num_prompt_tokens=1,
            sampling_params=_GREEDY, block_ids=(list(range(1 + i * blocks, 1 + (i + 1) * blocks)),),
            num_computed_tokens=1))
        num_scheduled[req_id] = query_len
        drafts[req_id] = [0] * (query_len - 1)
    run = SchedulerOutput(new_reqs, CachedRequestData(), num_scheduled, num_reqs * query_len,
                          set(), scheduled_spec_decode_tokens=drafts)
    finish = SchedulerOutput([], CachedRequestData(), {}, 0, set(num_scheduled))
    return run, finish


class StepRunner(Protocol):
    """What captures run their plans through: the runner's own step path."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> None: ...

    def sample_tokens(self) -> ModelRunnerOutput: ...


def run_plans(runner: StepRunner, plans: Plans) -> None:
    run, finish = plans
    runner.execute_model(run)
    runner.sample_tokens()
    runner.execute_model(finish)


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
        plans = {size: dummy_plans(prompt_lens(size, self.max_model_len, bs), bs, _GREEDY,
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
        return dummy_plans([DECODE_QUERY_LEN] * size, self.block_size, _GREEDY, "capture")

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
