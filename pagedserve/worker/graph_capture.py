"""Start-up graph capture through the runner's own step path.

Each capture size gets two dummy plans, run exactly like real steps (same buffers, same input
prep, same metadata), so a replay later reads the very addresses the capture recorded:
- FULL: ``size`` new requests with a one-token prompt each: a uniform decode batch;
- PIECEWISE: one new request with a ``size``-token prompt: a prefill batch.
Every plan runs twice: once eagerly (the warm-up JIT-compiles every Triton specialization
outside the capture), then in its graph mode, when the graph wrappers capture. Sizes go from
the largest down, so the smaller captures reuse the memory pool of the larger ones.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from pagedserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.block_table import cdiv
from pagedserve.worker.cudagraph import CudaGraphMode

if TYPE_CHECKING:
    from pagedserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def _plan(prompt_lens: list[int], block_size: int) -> tuple[SchedulerOutput, SchedulerOutput]:
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


def _run(runner: ModelRunner, plans: tuple[SchedulerOutput, SchedulerOutput]) -> None:
    run, finish = plans
    runner.execute_model(run)
    runner.sample_tokens()
    runner.execute_model(finish)


def capture_graphs(runner: ModelRunner) -> dict[str, list[int]]:
    """Capture every FULL and PIECEWISE size the runner's limits can reach; returns them."""
    start = time.perf_counter()
    before = torch.cuda.memory_allocated(runner.device)
    bs, max_blocks = runner.block_size, runner.num_blocks - 1
    captured: dict[str, list[int]] = {"FULL": [], "PIECEWISE": []}
    for size in sorted(runner.capture_sizes, reverse=True):
        jobs = []
        if size <= min(runner.max_num_reqs, runner.max_num_batched_tokens, max_blocks):
            jobs.append((CudaGraphMode.FULL, [1] * size))
        if 2 <= size <= min(runner.max_num_batched_tokens, runner.max_model_len, max_blocks * bs):
            jobs.append((CudaGraphMode.PIECEWISE, [size]))
        for mode, prompt_lens in jobs:
            plans = _plan(prompt_lens, bs)
            _run(runner, plans)  # warm-up, eager
            runner.capturing = mode
            try:
                _run(runner, plans)
            finally:
                runner.capturing = None
            runner.captured_sizes[mode].add(size)
            captured[mode.name].append(size)
    torch.cuda.synchronize(runner.device)
    logger.info(
        "captured %d FULL and %d PIECEWISE graphs in %.1f s (%.2f GiB)",
        len(captured["FULL"]), len(captured["PIECEWISE"]), time.perf_counter() - start,
        (torch.cuda.memory_allocated(runner.device) - before) / 2**30,
    )  # fmt: skip
    return captured
