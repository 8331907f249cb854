"""Time GPU work as the engine runs it: captured in a CUDA graph, replayed (benchmarks only)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from pagedserve.entrypoints.bench.roofline import MEASURED_CEILINGS

# The H200's measured device copy (bytes/s) and bf16 matmul rate (FLOP/s), as the roofline uses.
COPY_BANDWIDTH, MATMUL_PEAK = MEASURED_CEILINGS["H200"]


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``fn``, after one eager warm-up on a side stream (so lazy work such as
    Triton compiles and cuBLAS workspaces stays out of it)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


@contextmanager
def sm_carveout(carveout: int) -> Iterator[None]:
    """GEMMs launched inside target (SMs - carveout) SMs
    (``torch._C._set_sm_carveout_experimental``; honoured on the cuBLASLt path:
    ``torch.backends.cuda.preferred_blas_library("cublaslt")``)."""
    torch._C._set_sm_carveout_experimental(carveout or None)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(None)


def carved_graph(fn: Callable[[], object], carveout: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``fn`` captured inside ``sm_carveout(carveout)``."""
    with sm_carveout(carveout):
        return capture_graph(fn)


def timed_ms(launch: Callable[[], object]) -> float:
    """ms between events recorded around one ``launch()`` on the current stream (waits for it)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    launch()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def median_ms(launch: Callable[[], object], reps: int = 20) -> float:
    """Median ms between events recorded around ``launch()`` on the current stream (after one
    untimed call)."""
    launch()
    torch.cuda.synchronize()
    times = [timed_ms(launch) for _ in range(reps)]
    return sorted(times)[len(times) // 2]


def graph_time_ms(fn: Callable[[], object], reps: int = 20) -> float:
    """Median ms of one replay of a CUDA graph of ``fn``."""
    graph = capture_graph(fn)
    ms = median_ms(graph.replay, reps)
    del graph
    return ms
