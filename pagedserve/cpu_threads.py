"""The CPU engine's torch thread count, kept to the cores other processes leave idle while the
engine runs (``docs/cpu.md#threads-and-the-allocator``).

Why it moves: torch splits each op across its OpenMP threads and waits for all of them, so a
thread whose core another process holds stalls every op by a scheduler time slice; on a busy
machine one thread is several times faster than two, on an idle one two are faster than one.
Start-up chooses from the load average (``configure_cpu_threads``); between steps,
``ThreadGovernor`` (from ``cpu_thread_governor``) measures how much of the usable cores other processes used over the last
second and sets the count again, so a core busy for a moment at start-up does not halve the
engine's compute for its whole life, and a load that comes later takes a thread away.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

SAMPLE_INTERVAL_S = 1.0
"""How often the governor measures the other processes' use of the cores."""


@dataclass(frozen=True)
class CpuTimes:
    """Cumulative CPU seconds: every process's busy time on the usable cores, and this
    process's own (all of its threads)."""

    machine_busy_s: float
    own_s: float


def usable_cpu_cores() -> int:
    """Cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_beside(cores: int, others_busy_cores: float) -> int:
    """The cores that ``others_busy_cores`` of other processes' work leaves idle, at least 1
    (a core counts as taken from half a core's use on). One thread too few costs at most that
    thread's speed-up; one too many costs a scheduler time slice per op
    (docs/cpu.md#threads-and-the-allocator has the measurements)."""
    if cores < 1:
        raise ValueError(f"cores: expected >= 1, got {cores}")
    return max(1, min(cores, cores - int(others_busy_cores + 0.5)))


def configure_cpu_threads() -> int:
    """Lower torch's CPU thread count to the idle cores, once at engine start-up, taking the
    1-minute load average (runnable processes before this engine started working) as the
    other processes' cores. Never raises it: a count chosen before (``OMP_NUM_THREADS``, which
    torch reads itself, or ``torch.set_num_threads``) is an upper bound. Returns the thread
    count in effect."""
    if "OMP_NUM_THREADS" not in os.environ:
        policy = threads_beside(usable_cpu_cores(), os.getloadavg()[0])
        torch.set_num_threads(min(torch.get_num_threads(), policy))
    return torch.get_num_threads()


def cpu_thread_governor(max_threads: int) -> ThreadGovernor | None:
    """The between-steps hook that keeps torch's thread count to the idle cores, up to
    ``max_threads``; None where the user fixed the count (``OMP_NUM_THREADS``) or
    ``/proc/stat`` cannot be read."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    try:
        cpus = frozenset(os.sched_getaffinity(0))
        read_cpu_times(cpus)
    except (AttributeError, OSError, ValueError):
        return None
    return ThreadGovernor(len(cpus), max_threads, lambda: read_cpu_times(cpus))


def read_cpu_times(cpus: Collection[int]) -> CpuTimes:
    """``/proc/stat``'s busy time (everything but idle and iowait, steal included: the
    hypervisor gave the core to someone else) summed over ``cpus``, and this process's CPU
    time."""
    tick = os.sysconf("SC_CLK_TCK")
    busy = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if not name.startswith("cpu") or name == "cpu":
                continue
            if int(name[3:]) in cpus:
                values = [int(v) for v in fields[:8]]
                busy += sum(values) - values[3] - values[4]  # minus idle, iowait
    own = os.times()
    return CpuTimes(busy / tick, own.user + own.system)


class ThreadGovernor:
    """Sets torch's thread count between steps to the ``cores`` other processes left idle
    over the last ``SAMPLE_INTERVAL_S``, between 1 and ``max_threads``. Call it before each step
    from the thread that runs the model (torch's count is that thread's setting)."""

    def __init__(
        self,
        cores: int,
        max_threads: int,
        cpu_times: Callable[[], CpuTimes],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cores = cores  # usable cores; cpu_times measures these
        self.max_threads = max_threads
        self._cpu_times = cpu_times
        self._clock = clock
        self._last_time = clock()
        self._last = cpu_times()

    def __call__(self) -> None:
        now = self._clock()
        elapsed = now - self._last_time
        if elapsed < SAMPLE_INTERVAL_S:
            return
        times = self._cpu_times()
        others = (times.machine_busy_s - self._last.machine_busy_s) - (
            times.own_s - self._last.own_s
        )
        self._last_time, self._last = now, times
        idle = threads_beside(self.cores, max(0.0, others) / elapsed)
        threads = min(self.max_threads, idle)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
