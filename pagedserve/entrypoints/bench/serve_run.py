"""The load of ``bench serve``: requests sent at Poisson arrival times (``request_rate``
per second; ``inf`` sends them all at once), at most ``max_concurrency`` in flight, with a
progress bar of finished requests."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Iterator

import numpy as np
from tqdm import tqdm

from pagedserve.entrypoints.bench.serve_client import RequestResult
from pagedserve.entrypoints.bench.serve_dataset import SampleRequest


def arrival_gaps(num_requests: int, request_rate: float, seed: int) -> Iterator[float]:
    """Seconds to wait before each request: exponential gaps of mean ``1 / request_rate``
    (a Poisson process), or none for an infinite rate."""
    if not request_rate > 0:
        raise ValueError(f"request_rate: must be positive (or inf), got {request_rate}")
    rng = np.random.default_rng(seed)
    for _ in range(num_requests):
        yield 0.0 if math.isinf(request_rate) else float(rng.exponential(1.0 / request_rate))


async def run_load(
    samples: list[SampleRequest],
    send: Callable[[SampleRequest], Awaitable[RequestResult]],
    request_rate: float,
    max_concurrency: int | None,
    seed: int,
    show_progress: bool,
) -> tuple[list[RequestResult], float]:
    """Send every sample; returns the results (in sample order) and the wall time in seconds."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency: must be >= 1, got {max_concurrency}")
    limit = asyncio.Semaphore(max_concurrency or len(samples))
    progress = tqdm(total=len(samples), disable=not show_progress, unit="req")

    async def one(sample: SampleRequest) -> RequestResult:
        async with limit:
            result = await send(sample)
        progress.update(1)
        return result

    start = time.perf_counter()
    tasks = []
    for sample, gap in zip(samples, arrival_gaps(len(samples), request_rate, seed), strict=True):
        if gap > 0:
            await asyncio.sleep(gap)
        tasks.append(asyncio.ensure_future(one(sample)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    progress.close()
    return list(results), duration
