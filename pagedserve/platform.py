"""Where the engine runs: device choice and the dtype ``auto`` resolves to.

Detected once at start-up (never in a hot path).
"""

from __future__ import annotations

import functools
import os

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


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
    """Set torch's CPU thread count once at engine start-up, unless the user chose one with
    ``OMP_NUM_THREADS`` (torch reads that itself). Returns the thread count in effect."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(cpu_thread_count(usable_cpu_cores(), os.getloadavg()[0]))
    return torch.get_num_threads()
