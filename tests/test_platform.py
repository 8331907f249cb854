"""Start-up platform choices: the CPU thread count for a machine whose cores others may use,
and the allocator settings of a CPU process."""

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


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def four_cores_one_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "usable_cpu_cores", lambda: 4)
    monkeypatch.setattr(platform.os, "getloadavg", lambda: (1.2, 0.0, 0.0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


@pytest.mark.usefixtures("restore_threads", "four_cores_one_busy")
def test_configure_cpu_threads_respects_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(4)
    assert platform.configure_cpu_threads() == 3
    torch.set_num_threads(4)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert platform.configure_cpu_threads() == 4  # the user's choice is left alone


@pytest.mark.usefixtures("restore_threads", "four_cores_one_busy")
def test_configure_cpu_threads_never_raises_the_count() -> None:
    torch.set_num_threads(1)  # chosen earlier (a test's conftest, a user)
    assert platform.configure_cpu_threads() == 1


def test_configure_cpu_allocator_sets_every_option(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []

    class FakeLibc:
        def mallopt(self, param: int, value: int) -> int:
            calls.append((param, value))
            return 1

    monkeypatch.setattr(platform.ctypes, "CDLL", lambda name: FakeLibc())
    assert platform.configure_cpu_allocator() is True
    assert dict(calls) == platform.CPU_MALLOC_OPTIONS


def test_configure_cpu_allocator_without_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_libc(name: str) -> None:
        raise OSError(f"{name}: not found")

    monkeypatch.setattr(platform.ctypes, "CDLL", no_libc)
    assert platform.configure_cpu_allocator() is False


def test_configure_cpu_allocator_reports_a_rejected_option(monkeypatch: pytest.MonkeyPatch) -> None:
    class OldLibc:
        def mallopt(self, param: int, value: int) -> int:
            return 0 if param == -3 else 1  # M_MMAP_THRESHOLD refused

    monkeypatch.setattr(platform.ctypes, "CDLL", lambda name: OldLibc())
    assert platform.configure_cpu_allocator() is False


@pytest.mark.usefixtures("restore_threads")
def test_configure_process_leaves_gpu_processes_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    touched: list[str] = []
    monkeypatch.setattr(platform, "configure_cpu_threads", lambda: touched.append("threads") or 1)
    monkeypatch.setattr(
        platform, "configure_cpu_allocator", lambda: touched.append("malloc") or True
    )
    platform.configure_process("cuda:0")
    assert touched == []
    platform.configure_process("cpu")
    assert touched == ["threads", "malloc"]


def test_usable_cpu_cores_is_positive() -> None:
    assert platform.usable_cpu_cores() >= 1


def test_fp8_linear_backend_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU dequantizes; an FP8 GPU uses tensor cores; an older GPU is refused by name."""
    assert platform.fp8_linear_backend(torch.device("cpu")) == "dequantize"
    assert platform.fp8_linear_backend(torch.device("meta")) == "dequantize"
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert platform.fp8_linear_backend(cuda) == "scaled_mm"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"quantization: FP8 .*NVIDIA A100 is 8\.0"):
        platform.fp8_linear_backend(cuda)
