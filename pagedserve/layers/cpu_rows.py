"""Row-wise C kernels for the torch layers on the CPU (``cpu_rows.c``): RMSNorm with the residual
add, SiLU-and-mul, and the rotary embedding with the KV-cache write, each one pass over the
step's rows; and the argmax of logit rows for greedy sampling.

Why: on a prompt of 2,048 rows, the torch code of these layers is several ops per layer, each a
pass over ``[rows, hidden]`` or ``[rows, intermediate]`` with casts between bf16 and fp32, and
together they cost about a fifth of what the linears do (docs/cpu.md#prompt-rows-in-c). The
kernels round as the torch code does (``row_ops.h``), which stays the reference and runs
wherever they do not apply: another device, a traced forward, dtypes other than bf16 and fp32,
layouts they do not index, no C compiler (logged once). Built as the other CPU kernels
(``attention/backends/cpu_native``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_rows.c")
DTYPES = (torch.float32, torch.bfloat16)

_p, _i64, _int, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class RopeRows(ctypes.Structure):
    """``RopeRows`` of cpu_rows.c."""

    _fields_ = [*[(name, _p) for name in (
        "query", "key", "value", "cos_sin", "slots", "query_out", "key_cache", "value_cache")],
        *[(name, _i64) for name in (
            "m", "num_heads", "num_kv_heads", "head_dim", "block_size", "cache_block_stride",
            "query_stride", "key_stride", "value_stride")]]


def library_of(source: Path) -> ctypes.CDLL:
    """``source`` (cpu_rows.c or a copy of it) built, its functions' argument types set.
    OSError, RuntimeError or SubprocessError where it cannot be built here."""
    from pagedserve.attention.backends.cpu_native import built_library

    lib = ctypes.CDLL(str(built_library(source)))
    lib.add_rms_norm_rows.argtypes = [_p] * 3 + [_f32, _p, _p, _i64, _i64, _int, _int]
    lib.silu_and_mul_rows.argtypes = [_p, _i64, _p, _i64, _i64, _int, _int]
    lib.rope_write_kv_rows.argtypes = [ctypes.POINTER(RopeRows), _int, _int]
    for fn in (lib.add_rms_norm_rows, lib.silu_and_mul_rows, lib.rope_write_kv_rows):
        fn.restype = _int
    lib.argmax_rows.argtypes = [_p, _i64, _i64, _i64, _int, _p, _int]
    lib.argmax_rows.restype = None
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built library; None (logged once) where it cannot be built here."""
    try:
        return library_of(SOURCE)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("CPU row kernels not built (%s): the torch code runs", e)
        return None


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the kernels serve these tensors: on the CPU, eager, one dtype of ``DTYPES``."""
    first = tensors[0]
    return (first.device.type == "cpu" and first.dtype in DTYPES
            and all(t.dtype == first.dtype and t.device.type == "cpu" for t in tensors)
            and not torch.compiler.is_compiling() and _library() is not None)


def _call(status: int, name: str) -> None:
    if status != 0:
        raise MemoryError(f"{name}: no thread could allocate its row buffer")


def add_rms_norm_rows(
    x: torch.Tensor,  # [m, n]
    residual: torch.Tensor | None,  # [m, n] or None
    weight: torch.Tensor,  # [n]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(RMSNorm(x + residual), x + residual), or (RMSNorm(x), None) without a residual; None
    where the kernel does not apply (the caller runs the torch code)."""
    parts = (x, weight) if residual is None else (x, weight, residual)
    if not (applies(*parts) and x.dim() == 2 and x.is_contiguous() and weight.is_contiguous()
            and weight.shape == (x.shape[1],)
            and (residual is None or (residual.shape == x.shape and residual.is_contiguous()))):
        return None
    out = torch.empty_like(x)  # [m, n]
    summed = None if residual is None else torch.empty_like(x)  # [m, n]
    lib = _library()
    assert lib is not None
    _call(lib.add_rms_norm_rows(
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), eps,
        out.data_ptr(), None if summed is None else summed.data_ptr(), x.shape[0], x.shape[1],
        int(x.dtype == torch.bfloat16), torch.get_num_threads()), "add_rms_norm_rows")
    return out, summed


def silu_and_mul_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x [m, 2 d] = [gate | up] -> silu(gate) * up [m, d]; None where the kernel does not
    apply."""
    if not (applies(x) and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0):
        return None
    d = x.shape[1] // 2
    out = x.new_empty((x.shape[0], d))  # [m, d]
    lib = _library()
    assert lib is not None
    _call(lib.silu_and_mul_rows(x.data_ptr(), x.stride(0), out.data_ptr(), x.shape[0], d,
                                int(x.dtype == torch.bfloat16), torch.get_num_threads()),
          "silu_and_mul_rows")
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x [m, n] -> int64 [m]: each row's index of its largest value, the first of equal ones
    (torch.argmax's rule; a row with a NaN gets an unspecified index); None where the kernel
    does not apply. torch's CPU argmax reads the rows several times slower
    (docs/cpu.md#greedy-argmax)."""
    if not (applies(x) and x.dim() == 2 and x.stride(1) == 1 and x.shape[0] > 0
            and 0 < x.shape[1] < 2**31):
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)  # [m]
    lib = _library()
    assert lib is not None
    lib.argmax_rows(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1],
                    int(x.dtype == torch.bfloat16), out.data_ptr(), torch.get_num_threads())
    return out


def rope_and_write_kv_rows(
    query: torch.Tensor,  # [m, Hq * D]
    key: torch.Tensor,  # [m, Hkv * D]
    value: torch.Tensor,  # [m, Hkv * D]
    cos_sin: torch.Tensor,  # [m, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # int64 [m]
) -> torch.Tensor | None:
    """The rotated queries [m, Hq * D], the rotated keys and the values written at the rows'
    slots (-1: none); None where the kernel does not apply."""
    m, (_, num_blocks, block_size, num_kv_heads, head_dim) = query.shape[0], kv_cache.shape
    if not (applies(query, key, value, cos_sin, kv_cache) and kv_cache[0, 0].is_contiguous()
            and all(t.dim() == 2 and t.stride(1) == 1 and t.shape[0] == m
                    for t in (query, key, value, cos_sin))
            and cos_sin.shape[1] == head_dim and head_dim % 2 == 0
            and key.shape[1] == value.shape[1] == num_kv_heads * head_dim
            and query.shape[1] % head_dim == 0
            and slot_mapping.dtype == torch.int64 and slot_mapping.shape == (m,)
            and slot_mapping.is_contiguous()):
        return None
    if m and int(slot_mapping.max()) >= num_blocks * block_size:
        raise ValueError(f"slot_mapping: a slot past the cache's {num_blocks * block_size}")
    out = query.new_empty(query.shape)  # [m, Hq * D]
    rows = RopeRows(
        query.data_ptr(), key.data_ptr(), value.data_ptr(), cos_sin.data_ptr(),
        slot_mapping.data_ptr(), out.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
        m, query.shape[1] // head_dim, num_kv_heads, head_dim, block_size, kv_cache.stride(1),
        query.stride(0), key.stride(0), value.stride(0))
    lib = _library()
    assert lib is not None
    _call(lib.rope_write_kv_rows(ctypes.byref(rows), int(query.dtype == torch.bfloat16),
                                 torch.get_num_threads()), "rope_write_kv_rows")
    return out
