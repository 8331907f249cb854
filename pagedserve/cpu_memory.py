"""Host memory of a CPU engine process: glibc's malloc made to keep freed memory, zero-filled
tensors that cost memory only as they fill, and what the machine has available
(docs/cpu.md#threads-and-the-allocator).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os

import torch

# glibc ``mallopt`` parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
CPU_MALLOC_OPTIONS = {
    _M_MMAP_THRESHOLD: 1 << 30,  # blocks up to 1 GiB come from the heap, not fresh mmaps
    _M_TRIM_THRESHOLD: (1 << 31) - 1,  # keep freed heap memory (int max: never trim)
    _M_TOP_PAD: 64 << 20,  # grow the heap 64 MiB at a time
}
"""What ``configure_cpu_allocator`` sets: glibc parameter -> value."""


def configure_cpu_allocator() -> bool:
    """Make glibc's malloc keep and reuse the memory of freed tensors. Returns False where the
    C library is not glibc or refuses one of the options.

    Why: torch's CPU tensors come from ``malloc``. By default glibc serves large blocks with
    fresh ``mmap`` calls and gives freed memory back to the system, so each step's big
    temporaries (activations, gathered KV blocks) fault their pages in again, every step.
    Page faults are cheap on an idle machine and expensive on a busy one
    (docs/cpu.md#threads-and-the-allocator has the measurements). Memory the process once used
    stays with it (its peak, as a server's). Process-wide; call once at start-up, before the
    work that allocates.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    accepted = [mallopt(param, value) == 1 for param, value in CPU_MALLOC_OPTIONS.items()]
    return all(accepted)


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor on a private anonymous memory map: the kernel maps its pages
    in zeroed on first touch, so untouched parts cost neither time nor memory (``torch.zeros``
    writes every byte up front)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(nbytes, 1))  # the tensor keeps the map alive
    return torch.frombuffer(buffer, dtype=dtype, count=math.prod(shape)).view(shape)


def available_host_bytes() -> int:
    """``MemAvailable`` of /proc/meminfo (what can be allocated without swapping), else the
    machine's free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
