"""GPU busy fraction while a workload runs: NVML's utilization (the share of time a kernel was
running, as ``nvidia-smi`` reports it), sampled in a background thread; and the exact figure
from a kernel trace (``busy_union_us`` over the profiler's kernel intervals)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


class GpuBusySampler:
    def __init__(self, device: torch.device, interval_s: float = 0.1) -> None:
        self.device = device
        self.interval_s = interval_s
        self.samples: list[int] = []  # NVML utilization percentages
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append(torch.cuda.utilization(self.device))

    def measure(self, fn: Callable[[], T]) -> T:
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        try:
            return fn()
        finally:
            self._stop.set()
            thread.join()

    @property
    def busy_fraction(self) -> float | None:
        return sum(self.samples) / (100 * len(self.samples)) if self.samples else None


def busy_union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (overlapping kernels count once)."""
    total, current_end = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if start > current_end:
            total += end - start
            current_end = end
        elif end > current_end:
            total += end - current_end
            current_end = end
    return total
