"""Where the engine runs: device choice and the dtype ``auto`` resolves to.

Detected once at start-up (never in a hot path).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path
from typing import Literal

import torch

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/pagedserve`` if set, else ``~/.cache/pagedserve``: converted
    tokenizers, compiled CPU kernels."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedserve"


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} asked for, but no CUDA device is available")
    return torch.device(device)


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bf16 matrices natively (AMX tiles or AVX512-BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return any(flag in flags for flag in ("amx_bf16", "avx512_bf16"))


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on GPUs and on CPUs with native bf16 matmuls, else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda" or cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: unknown dtype {dtype!r}")
    return _DTYPES[dtype]


def usable_cpu_cores() -> int:
    """Cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_thread_count(cores: int, load_average: float) -> int:
    """Threads for torch's CPU kernels: the cores that other processes leave idle, at least 1.

    Why not every core: torch splits each op across its OpenMP threads and waits for all of
    them. When another process holds one of the cores, every op waits for the thread that is
    not running (a scheduler time slice, milliseconds): measured on 2 shared cores,
    dequantizing the default model took 10-12 s with 2 threads and 0.26 s with 1, and a
    64-row bf16 linear 11 ms instead of 0.3 ms. One thread too few costs at most the
    speed-up of that thread; one too many can cost 40x. ``load_average`` is the 1-minute load
    (runnable processes) measured before this engine started working.
    """
    if cores < 1:
        raise ValueError(f"cores: expected >= 1, got {cores}")
    busy = int(load_average + 0.5)  # processes already running on this machine's cores
    return max(1, min(cores, cores - busy))


def configure_cpu_threads() -> int:
    """Lower torch's CPU thread count to the idle cores, once at engine start-up. Never raises
    it: a count chosen before (``OMP_NUM_THREADS``, which torch reads itself, or
    ``torch.set_num_threads``) is an upper bound. Returns the thread count in effect."""
    if "OMP_NUM_THREADS" not in os.environ:
        policy = cpu_thread_count(usable_cpu_cores(), os.getloadavg()[0])
        torch.set_num_threads(min(torch.get_num_threads(), policy))
    return torch.get_num_threads()


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
    Page faults are cheap on an idle machine and expensive on a busy one. Measured on the
    default model (bf16, 64 requests of 128 tokens, 1 thread, 2-core VM): with other jobs
    loading it (load average ~3.3) the 8192-token prefill took 19.3 s with 1.04 M page faults
    and 11.7 s with 0.44 M with these settings, a decode step 321 ms and 206 ms; idle (load
    ~0.8) the whole 64 x 128-token run took 41.3-45.5 s and 40.6-41.4 s. Memory the process
    once used stays with it (its peak, as a server's). Process-wide; call once at start-up,
    before the work that allocates.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    accepted = [mallopt(param, value) == 1 for param, value in CPU_MALLOC_OPTIONS.items()]
    return all(accepted)


def configure_process(device: str | torch.device) -> None:
    """Engine start-up settings of this process for ``device``: on the CPU, the thread count
    (``configure_cpu_threads``) and the allocator (``configure_cpu_allocator``); nothing on
    GPUs."""
    if torch.device(device).type != "cpu":
        return
    threads = configure_cpu_threads()
    allocator = "tuned" if configure_cpu_allocator() else "default (mallopt missing or refused)"
    logger.info("CPU start-up: %d torch threads, malloc %s", threads, allocator)


Fp8Backend = Literal["scaled_mm", "dequantize"]
FP8_MIN_CAPABILITY = (8, 9)
"""The first NVIDIA compute capability with FP8 tensor cores (Ada; Hopper is 9.0)."""


def fp8_linear_backend(device: torch.device) -> Fp8Backend:
    """How FP8 linear layers compute on ``device``: ``"scaled_mm"`` (FP8 tensor cores through
    ``torch._scaled_mm``) on CUDA GPUs of compute capability 8.9 and up, ``"dequantize"``
    (FP8 storage, the matmul in the compute dtype) on the CPU and the ``meta`` device.
    ValueError for a GPU without FP8 tensor cores and any other device."""
    if device.type in ("cpu", "meta"):
        return "dequantize"
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability >= FP8_MIN_CAPABILITY:
            return "scaled_mm"
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"quantization: FP8 needs FP8 tensor cores (compute capability 8.9 or newer); "
            f"{name} is {capability[0]}.{capability[1]}"
        )
    raise ValueError(f"quantization: FP8 is not supported on device {device.type!r}")
