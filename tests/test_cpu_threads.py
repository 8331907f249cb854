"""The CPU thread governor: the thread count follows the cores other processes leave idle."""

from __future__ import annotations

import os

import pytest
import torch

from pagedserve import cpu_threads
from pagedserve.cpu_threads import CpuTimes, ThreadGovernor, threads_beside


@pytest.mark.parametrize(
    ("cores", "others", "expected"),
    [
        (2, 0.0, 2),  # idle machine: every core
        (2, 0.4, 2),  # a little background noise does not take a core
        (2, 0.7, 1),  # a busy loop sharing the cores with two engine threads
        (2, 3.0, 1),  # oversubscribed: still one thread
        (16, 3.6, 12),
        (1, 0.0, 1),
    ],
)
def test_threads_beside_leaves_busy_cores_alone(cores: int, others: float, expected: int) -> None:
    assert threads_beside(cores, others) == expected


def test_threads_beside_rejects_no_cores() -> None:
    with pytest.raises(ValueError, match="cores"):
        threads_beside(0, 0.0)


class FakeMachine:
    """A clock and CPU-time counters the test advances by hand."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = 0.0
        self.own = 0.0

    def run(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.now += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + other_cores) * seconds

    def times(self) -> CpuTimes:
        return CpuTimes(self.busy, self.own)


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("restore_threads")
def test_governor_follows_the_other_processes_load() -> None:
    machine = FakeMachine()
    governor = ThreadGovernor(2, 2, machine.times, clock=lambda: machine.now)
    torch.set_num_threads(1)  # start-up saw a core busy for a moment
    machine.run(1.0, own_cores=1.0, other_cores=0.1)
    governor()
    assert torch.get_num_threads() == 2  # the moment passed: both cores
    machine.run(0.5, own_cores=1.3, other_cores=0.7)
    governor()
    assert torch.get_num_threads() == 2  # within the interval: not measured yet
    machine.run(0.5, own_cores=1.3, other_cores=0.7)
    governor()
    assert torch.get_num_threads() == 1  # a busy loop came: one thread beside it
    machine.run(1.0, own_cores=1.0, other_cores=1.0)
    governor()
    assert torch.get_num_threads() == 1


@pytest.mark.usefixtures("restore_threads")
def test_governor_never_exceeds_its_ceiling() -> None:
    machine = FakeMachine()
    governor = ThreadGovernor(4, 2, machine.times, clock=lambda: machine.now)
    machine.run(1.0, own_cores=1.0, other_cores=0.0)
    governor()
    assert torch.get_num_threads() == 2


def test_a_fixed_thread_count_gets_no_governor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpu_threads.cpu_thread_governor(2) is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert isinstance(cpu_threads.cpu_thread_governor(2), ThreadGovernor)


def test_read_cpu_times_counts_this_process() -> None:
    cpus = os.sched_getaffinity(0)
    before = cpu_threads.read_cpu_times(cpus)
    sum(i * i for i in range(2_000_000))  # some CPU time of our own
    after = cpu_threads.read_cpu_times(cpus)
    assert after.own_s > before.own_s
    assert after.machine_busy_s > before.machine_busy_s


@pytest.mark.parametrize(
    ("cores", "load", "expected"),
    [
        (2, 0.0, 2),  # idle machine: every core
        (2, 0.4, 2),  # a little background noise does not take a core
        (2, 0.6, 1),  # one core busy elsewhere
        (2, 5.2, 1),  # oversubscribed: still one thread
        (16, 3.6, 12),
        (1, 0.0, 1),
    ],
)
def test_start_up_leaves_busy_cores_alone(cores: int, load: float, expected: int) -> None:
    """The load average taken as the other processes' cores."""
    assert cpu_threads.threads_beside(cores, load) == expected


@pytest.fixture
def four_cores_one_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_threads, "usable_cpu_cores", lambda: 4)
    monkeypatch.setattr(cpu_threads.os, "getloadavg", lambda: (1.2, 0.0, 0.0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


@pytest.mark.usefixtures("restore_threads", "four_cores_one_busy")
def test_configure_cpu_threads_respects_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(4)
    assert cpu_threads.configure_cpu_threads() == 3
    torch.set_num_threads(4)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert cpu_threads.configure_cpu_threads() == 4  # the user's choice is left alone


@pytest.mark.usefixtures("restore_threads", "four_cores_one_busy")
def test_configure_cpu_threads_never_raises_the_count() -> None:
    torch.set_num_threads(1)  # chosen earlier (a test's conftest, a user)
    assert cpu_threads.configure_cpu_threads() == 1


def test_usable_cpu_cores_is_positive() -> None:
    assert cpu_threads.usable_cpu_cores() >= 1
