"""GPU busy fraction and energy while a workload runs: NVML's utilization (the share of time a
kernel was running, as ``nvidia-smi`` reports it), sampled in a background thread, and NVML's
energy counter read before and after; and the exact busy figure from a kernel trace
(``busy_union_us`` over the profiler's kernel intervals).

The energy matters because the H200 runs at its 700 W power limit through a long decode
workload: the time of a step is then its energy over 700 W
(docs/performance.md#the-power-limit-and-the-power-floor).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def nvml_handle(device: torch.device | int) -> object | None:
    """NVML's handle of the CUDA ``device``, or None where NVML cannot be used."""
    try:
        import pynvml

        pynvml.nvmlInit()
        index = torch.cuda._get_nvml_device_index(device)  # NVML numbers every card
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # noqa: BLE001 - no pynvml, no driver
        return None


def nvml_energy_reader(device: torch.device | int) -> Callable[[], float] | None:
    """The card's total energy counter in joules (NVML), or None where NVML cannot read it."""
    handle = nvml_handle(device)
    if handle is None:
        return None
    import pynvml

    try:
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    except pynvml.NVMLError:  # a card without the counter
        return None
    return lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3


class GpuBusySampler:
    def __init__(
        self,
        device: torch.device,
        interval_s: float = 0.1,
        read_utilization: Callable[[], int] | None = None,
        read_energy_j: Callable[[], float] | None = None,
    ) -> None:
        """``read_utilization`` (percent) and ``read_energy_j`` default to NVML's for
        ``device``; the energy is left out (None) where NVML has no counter."""
        self.interval_s = interval_s
        self.read_utilization = read_utilization or (lambda: torch.cuda.utilization(device))
        self.read_energy_j = read_energy_j or nvml_energy_reader(device)
        self.samples: list[int] = []  # NVML utilization percentages
        self.energy_j: float | None = None  # joules the card used during measure()
        self.wall_s: float | None = None  # seconds measure() ran
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append(self.read_utilization())

    def measure(self, fn: Callable[[], T]) -> T:
        thread = threading.Thread(target=self._run, daemon=True)
        read_energy_j = self.read_energy_j
        energy_start = read_energy_j() if read_energy_j else None
        start = time.perf_counter()
        thread.start()
        try:
            return fn()
        finally:
            self._stop.set()
            thread.join()
            self.wall_s = time.perf_counter() - start
            if read_energy_j and energy_start is not None:
                self.energy_j = read_energy_j() - energy_start

    @property
    def busy_fraction(self) -> float | None:
        return sum(self.samples) / (100 * len(self.samples)) if self.samples else None

    @property
    def mean_power_w(self) -> float | None:
        if self.energy_j is None or not self.wall_s:
            return None
        return self.energy_j / self.wall_s


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
