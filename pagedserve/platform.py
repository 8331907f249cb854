"""Where the engine runs: device choice and the dtype ``auto`` resolves to.

Detected once at start-up (never in a hot path).
"""

from __future__ import annotations

import functools

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
