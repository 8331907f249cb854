"""The CPU process's host memory: glibc's malloc settings, and zero-filled tensors that cost
memory only as they fill."""

from __future__ import annotations

import pytest
import torch

from pagedserve import cpu_memory


def test_configure_cpu_allocator_sets_every_option(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []

    class FakeLibc:
        def mallopt(self, param: int, value: int) -> int:
            calls.append((param, value))
            return 1

    monkeypatch.setattr(cpu_memory.ctypes, "CDLL", lambda name: FakeLibc())
    assert cpu_memory.configure_cpu_allocator() is True
    assert dict(calls) == cpu_memory.CPU_MALLOC_OPTIONS


def test_configure_cpu_allocator_without_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_libc(name: str) -> None:
        raise OSError(f"{name}: not found")

    monkeypatch.setattr(cpu_memory.ctypes, "CDLL", no_libc)
    assert cpu_memory.configure_cpu_allocator() is False


def test_configure_cpu_allocator_reports_a_rejected_option(monkeypatch: pytest.MonkeyPatch) -> None:
    class OldLibc:
        def mallopt(self, param: int, value: int) -> int:
            return 0 if param == -3 else 1  # M_MMAP_THRESHOLD refused

    monkeypatch.setattr(cpu_memory.ctypes, "CDLL", lambda name: OldLibc())
    assert cpu_memory.configure_cpu_allocator() is False


def test_cpu_zeros_cost_no_memory_up_front() -> None:
    """The CPU KV cache's zeros: pages mapped in on first touch, zero until written."""
    before = _rss_bytes()
    cache = cpu_memory.zeroed_host_tensor((2, 1 << 16, 16, 8, 64), torch.bfloat16)  # 2 GiB
    assert cache.shape == (2, 1 << 16, 16, 8, 64) and cache.dtype == torch.bfloat16
    assert _rss_bytes() - before < 64 << 20
    assert cache[1, -1].abs().sum() == 0 and cache[0, 12345].abs().sum() == 0
    cache[0, 7] = 1.5
    assert cache[0, 7].sum() == 1.5 * 16 * 8 * 64 and cache[0, 8].sum() == 0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
