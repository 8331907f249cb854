"""Start-up graph capture through the runner's own step path, and what the graphs cost.

Each capture runs a dummy plan exactly like a real step (same buffers, same input prep, same
metadata), so a replay later reads the very addresses the capture recorded:
- FULL: ``size`` new requests with a one-token prompt each: a uniform decode batch, for each
  size of the dense FULL ladder (``CaptureLadders.full``);
- PIECEWISE: one new request with a ``size``-token prompt: a prefill batch, for each size of
  the sparse PIECEWISE ladder (``CaptureLadders.piecewise``): each size costs one graph per
  compiled piece (33 for Llama-3-8B), so this ladder sets most of the capture time.
Sizes go from the largest down, so smaller captures reuse the pool memory of larger ones, and
every capture phase runs on the pool's side stream (``GraphPool.capture_phase``).

Warm-ups (an eager run of the same plan before capturing) exist so that nothing lazy happens
inside a capture: Triton JIT compiles, cuBLAS workspace allocation. Where they are needed:
- PIECEWISE graphs hold compiled pieces only. Their kernels were compiled and tuned once for
  the symbolic size by the first (profile) run, and attention runs eagerly between the
  pieces, outside any graph. One warm-up on the capture stream (its cuBLAS workspace) serves
  every size, instead of one per size.
- FULL graphs hold the Triton kernels (attention, input prep), whose JIT specializations
  depend on integer arguments (request counts divisible by 16, equal to 1, ...), so a size may
  need a kernel no earlier run compiled. A Triton compile and module load inside a capture is
  allowed (host work; nothing is recorded; measured on the H200 with torch 2.11 in every
  capture error mode), so only the largest FULL size gets a warm-up (cuBLAS at decode shapes)
  and the others none: a warm-up per size was a whole eager step each, ~0.8 s of a warm
  start's 35 FULL captures.

Memory (issue #7): PIECEWISE graphs do not touch the KV cache (attention runs outside them), so
``capture_before_kv_cache`` captures all of them during profiling, on the temporary cache, and
measures exactly what they hold. FULL graphs bake the KV cache's address in, so they are
captured after the cache exists; before it, a probe captures the two largest FULL sizes,
measures them and drops them: the first holds the FULL graphs' extra pool memory, the second
the per-graph memory (driver-side graph state), and the estimate is first + (n - 1) x second.
The pool blocks the probe leaves behind stay in the pool, and the real FULL captures reuse them.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from pagedserve.compilation.cuda_graph import GraphPool
from pagedserve.compilation.phase_log import log_phase
from pagedserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve.math_utils import cdiv
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.cudagraph import CudaGraphMode
from pagedserve.worker.kv_cache import used_device_bytes

if TYPE_CHECKING:
    from pagedserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
_GIB = 2**30
Plans = tuple[SchedulerOutput, SchedulerOutput]


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


def _plan(prompt_lens: list[int], block_size: int) -> Plans:
    """A step of new requests with these prompt lengths (blocks from 1 up), and the plan that
    frees them again."""
    new_reqs, num_scheduled, next_block = [], {}, 1
    for i, n in enumerate(prompt_lens):
        req_id = f"capture-{i}"
        blocks = cdiv(n, block_size)
        new_reqs.append(NewRequestData(
            req_id=req_id, prefill_token_ids=[0] * n, num_prompt_tokens=n,
            sampling_params=_GREEDY, block_ids=(list(range(next_block, next_block + blocks)),),
            num_computed_tokens=0,
        ))  # fmt: skip
        num_scheduled[req_id] = n
        next_block += blocks
    run = SchedulerOutput(new_reqs, CachedRequestData(), num_scheduled, sum(prompt_lens), set())
    finish = SchedulerOutput([], CachedRequestData(), {}, 0, set(num_scheduled))
    return run, finish


def _run(runner: ModelRunner, plans: Plans) -> None:
    run, finish = plans
    runner.execute_model(run)
    runner.sample_tokens()
    runner.execute_model(finish)


def _capture(runner: ModelRunner, mode: CudaGraphMode, size: int, plans: Plans) -> None:
    runner.capturing = mode
    try:
        _run(runner, plans)
    finally:
        runner.capturing = None
    runner.captured_sizes[mode].add(size)


def _graph_pool(runner: ModelRunner) -> GraphPool:
    compiled = runner.compiled_forward
    if compiled is None or compiled.graph_pool is None:
        raise ValueError("graph capture: the runner has no compiled forward with CUDA graphs")
    return compiled.graph_pool


def _runner_full_sizes(runner: ModelRunner) -> list[int]:
    return full_sizes(runner.capture_ladders.full, runner.max_num_reqs,
                      runner.max_num_batched_tokens, runner.num_blocks - 1)


def capture_piecewise(runner: ModelRunner) -> list[int]:
    """Capture every PIECEWISE size after one warm-up; records the memory they hold."""
    pool, device, bs = _graph_pool(runner), runner.device, runner.block_size
    ladders = runner.capture_ladders
    sizes = piecewise_sizes(ladders.piecewise + ladders.exact, runner.max_num_batched_tokens,
                            runner.max_num_reqs, runner.max_model_len, runner.num_blocks - 1, bs)
    plans = {size: _plan(prompt_lens(size, runner.max_model_len, bs), bs) for size in sizes}
    start, before = time.perf_counter(), used_device_bytes(device)
    with pool.capture_phase(device):
        if sizes:
            _run(runner, plans[sizes[0]])  # the one warm-up, on the capture stream
        for size in sizes:
            _capture(runner, CudaGraphMode.PIECEWISE, size, plans[size])
    pool.memory.piecewise = used_device_bytes(device) - before
    num_graphs = len(sizes) * len(runner.compiled_forward.piecewise_wrappers)
    log_phase(logger, "capture PIECEWISE", time.perf_counter() - start,
              f"{len(sizes)} sizes, {num_graphs} graphs, {pool.memory.piecewise / _GIB:.3f} GiB",
              sizes=len(sizes), graphs=num_graphs, bytes=pool.memory.piecewise)
    return sizes


def _full_plans(runner: ModelRunner, size: int) -> Plans:
    return _plan([1] * size, runner.block_size)


def _capture_full(runner: ModelRunner, size: int) -> None:
    _capture(runner, CudaGraphMode.FULL, size, _full_plans(runner, size))


def probe_full(runner: ModelRunner) -> int:
    """Estimate the FULL graphs' memory on the current (temporary) cache; drops the probe's
    graphs again (their pool blocks stay for the real captures) and returns the estimate."""
    pool, device = _graph_pool(runner), runner.device
    sizes = _runner_full_sizes(runner)
    start, before = time.perf_counter(), used_device_bytes(device)
    samples = []
    with pool.capture_phase(device):
        for i, size in enumerate(sizes[:2]):
            size_before = used_device_bytes(device)
            if i == 0:
                _run(runner, _full_plans(runner, size))  # the phase's one warm-up
            _capture_full(runner, size)
            samples.append(used_device_bytes(device) - size_before)
    for size in sizes[:2]:
        runner.compiled_forward.full_graph.drop(size)
        runner.captured_sizes[CudaGraphMode.FULL].discard(size)
    pool.memory.full_estimate = full_graph_estimate(samples, len(sizes))
    pool.memory.full_probe_kept = used_device_bytes(device) - before
    log_phase(logger, "probe FULL", time.perf_counter() - start,
              f"{len(sizes)} sizes, estimate {pool.memory.full_estimate / _GIB:.3f} GiB from "
              f"samples {[round(s / 2**20, 1) for s in samples]} MiB",
              sizes=len(sizes), estimate_bytes=pool.memory.full_estimate)
    return pool.memory.full_estimate


def capture_before_kv_cache(runner: ModelRunner) -> int:
    """During profiling, on the temporary cache: every PIECEWISE graph (kept) and the FULL
    probe. Returns the graph memory the KV budget must leave: PIECEWISE measured + FULL
    estimated."""
    capture_piecewise(runner)
    piecewise = max(_graph_pool(runner).memory.piecewise, 0)  # < 0: the driver gave pages back
    return piecewise + probe_full(runner)


def capture_graphs(runner: ModelRunner) -> dict[str, list[int]]:
    """After the KV cache exists: the PIECEWISE sizes if profiling did not capture them (a
    fixed block count skips profiling), then every FULL size. Returns the captured sizes."""
    pool, device = _graph_pool(runner), runner.device
    if not runner.captured_sizes[CudaGraphMode.PIECEWISE]:
        capture_piecewise(runner)
    sizes = _runner_full_sizes(runner)
    start, before = time.perf_counter(), used_device_bytes(device)
    with pool.capture_phase(device):
        if sizes:
            _run(runner, _full_plans(runner, sizes[0]))  # the phase's one warm-up
        for size in sizes:
            _capture_full(runner, size)
    memory = pool.memory
    memory.full = used_device_bytes(device) - before + memory.full_probe_kept
    actual = memory.piecewise + memory.full
    estimate = "" if memory.full_estimate is None else (
        f" (the KV budget left {(memory.piecewise + memory.full_estimate) / _GIB:.3f} GiB: "
        f"FULL estimated at {memory.full_estimate / _GIB:.3f} GiB)")
    log_phase(logger, "capture FULL", time.perf_counter() - start,
              f"{len(sizes)} graphs, {memory.full / _GIB:.3f} GiB; all graphs "
              f"{actual / _GIB:.3f} GiB{estimate}",
              graphs=len(sizes), bytes=memory.full, estimate_bytes=memory.full_estimate,
              all_graphs_bytes=actual)
    return {mode.name: sorted(runner.captured_sizes[mode], reverse=True)
            for mode in (CudaGraphMode.FULL, CudaGraphMode.PIECEWISE)}
