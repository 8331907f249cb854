"""Where the engine runs: the device, the dtype ``auto`` resolves to, and the ``Platform``,
the one place that knows what differs between devices.

``platform_for(device)`` is the only branch on the device type in the engine. Everything that
differs (which input-prep ops, token sampler and attention backend run, whether host buffers
are pinned, streams and events, memory queries, process-group backend, compile and CUDA-graph
defaults) is a field or method of the platform it returns. Components ask it once at start-up
and keep what it hands them; no step asks it again. The torch implementations are the CPU's
and the reference the tests hold the Triton ones to. The interface is ``base.Platform``;
``cpu.py`` and ``cuda.py`` implement it.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from pagedserve.platform.base import Platform
from pagedserve.platform.cpu import CpuPlatform
from pagedserve.platform.cuda import CudaPlatform

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


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on GPUs and on CPUs with native bf16 matmuls, else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if platform_for(device).native_bf16():
            return torch.bfloat16
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: unknown dtype {dtype!r}")
    return _DTYPES[dtype]


KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
"""``kv_cache_dtype`` values other than auto, and the cache's element type."""


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype,
                           device: torch.device) -> torch.dtype:
    """The KV cache's element type: the model's for ``auto``; float8_e4m3fn for ``fp8`` /
    ``fp8_e4m3``, where the device has FP8 (``Platform.require_fp8``)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: unknown {kv_cache_dtype!r} (auto, fp8, fp8_e4m3)")
    platform_for(device).require_fp8("kv_cache_dtype")
    return KV_CACHE_DTYPES[kv_cache_dtype]


_PLATFORMS: dict[str, type[Platform]] = {
    "cpu": CpuPlatform,
    "cuda": CudaPlatform,
    "meta": CpuPlatform,  # shapes only (a model built to read its parameter shapes): torch code
}


@functools.cache
def platform_for(device: torch.device | str) -> Platform:
    """The platform of ``device`` (a resolved device, not ``auto``): the one place that looks
    at the device type. Cheap and allocation-free (nothing touches the device), cached per
    device."""
    device = torch.device(device)
    kind = _PLATFORMS.get(device.type)
    if kind is None:
        raise ValueError(f"device: {str(device)!r} is not supported (cpu or cuda)")
    return kind(device)
