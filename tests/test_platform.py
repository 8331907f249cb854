"""Start-up platform choices: the CPU thread count for a machine whose cores others may use."""

from __future__ import annotations

import pytest
import torch

from pagedserve import platform


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
def test_cpu_thread_count_leaves_busy_cores_alone(cores: int, load: float, expected: int) -> None:
    assert platform.cpu_thread_count(cores, load) == expected


def test_cpu_thread_count_rejects_no_cores() -> None:
    with pytest.raises(ValueError, match="cores"):
        platform.cpu_thread_count(0, 0.0)


def test_configure_cpu_threads_respects_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(platform, "usable_cpu_cores", lambda: 4)
        monkeypatch.setattr(platform.os, "getloadavg", lambda: (1.2, 0.0, 0.0))
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert platform.configure_cpu_threads() == 3
        torch.set_num_threads(1)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert platform.configure_cpu_threads() == 1  # the user's choice is left alone
    finally:
        torch.set_num_threads(before)


def test_usable_cpu_cores_is_positive() -> None:
    assert platform.usable_cpu_cores() >= 1
