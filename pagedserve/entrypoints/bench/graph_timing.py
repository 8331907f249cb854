"""GPU work timed as the engine runs it: captured in a CUDA graph, then replayed.

For the kernel tuners (``benchmarks/attention_sweep.py``, ``benchmarks/gemv_sweep.py``): a
graph replay has no host launch gaps, as inside the engine's FULL graphs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


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


def timed_ms(launch: Callable[[], object]) -> float:
    """ms between events recorded around one ``launch()`` on the current stream (waits for it)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    launch()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def median_ms(launch: Callable[[], object], reps: int = 20) -> float:
    """Median ms of ``launch()`` over ``reps`` timed calls, after one untimed call."""
    launch()
    torch.cuda.synchronize()
    times = sorted(timed_ms(launch) for _ in range(reps))
    return times[len(times) // 2]


def graph_time_ms(fn: Callable[[], object], reps: int = 20) -> float:
    """Median ms of one replay of a CUDA graph of ``fn``."""
    graph = capture_graph(fn)
    ms = median_ms(graph.replay, reps)
    del graph
    return ms
