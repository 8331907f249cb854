"""The CPU's prefill-attention kernel (``paged_prefill.c``): the query rows of every prompt of a
step in one call, causal, over the paged cache read through the block table.

Why: torch's SDPA serves one request per call, on keys first gathered out of the cache, and on
this CPU its fused kernel runs short prompts (a few hundred rows, head_dim 64) well below the
core's multiply rate; the kernel multiplies bf16 queries, keys, probabilities and values
with the CPU's bf16 dot-product instruction (docs/cpu.md#c-prefill-kernel). Built as the
decode kernel is (``cpu_native``); None where it cannot be built (the caller keeps SDPA).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch

from pagedserve.attention.backends.cpu_native import built_library, has_copy_for, heads_packed

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_prefill.c")
_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class _Prefill(ctypes.Structure):
    """``Prefill`` of paged_prefill.c."""

    _fields_ = [*[(name, _p) for name in (
        "query", "key_cache", "value_cache", "block_table", "reqs", "output")],
        *[(name, _i64) for name in (
            "num_reqs", "num_heads", "num_kv_heads", "head_dim", "block_size", "table_stride",
            "query_row_stride", "output_row_stride", "cache_block_stride")],
        ("scale", ctypes.c_float)]


class PagedPrefillKernel:
    """``paged_prefill_attention`` of the built library."""

    def __init__(self, path: Path) -> None:
        self._fn = ctypes.CDLL(str(path)).paged_prefill_attention
        self._fn.argtypes = [ctypes.POINTER(_Prefill), ctypes.c_int, ctypes.c_int]
        self._fn.restype = ctypes.c_int

    @staticmethod
    def applies(query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor) -> bool:
        """The layouts and dtypes the kernel indexes (else the caller runs SDPA)."""
        return (has_copy_for(query.dtype, kv_cache.dtype, output.dtype)
                and heads_packed(query) and heads_packed(output)
                and output.shape == query.shape and bool(kv_cache[0, 0].is_contiguous())
                and query.shape[1] % kv_cache.shape[3] == 0 and query.shape[2] == kv_cache.shape[4])

    def __call__(
        self,
        query: torch.Tensor,  # [num_rows, Hq, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        block_table: torch.Tensor,  # int32 [num_all_reqs, max_num_blocks]
        reqs: torch.Tensor,  # int64 [n, 4]: first row, query_len, seq_len, block-table row
        scale: float,
        output: torch.Tensor,  # [num_rows, Hq, D], written at the requests' rows
    ) -> None:
        if not self.applies(query, kv_cache, output):
            raise ValueError("paged_prefill_attention: query/kv_cache/output do not fit")
        if (block_table.dtype != torch.int32 or block_table.stride(1) != 1
                or reqs.dtype != torch.int64 or not reqs.is_contiguous() or reqs.shape[1:] != (4,)):
            raise ValueError("block_table int32 rows, reqs int64 [n, 4] contiguous")
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        args = _Prefill(
            query.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
            block_table.data_ptr(), reqs.data_ptr(), output.data_ptr(), reqs.shape[0],
            query.shape[1], num_kv_heads, head_dim, block_size, block_table.stride(0),
            query.stride(0), output.stride(0), kv_cache.stride(1), scale)
        status = self._fn(ctypes.byref(args), int(query.dtype == torch.bfloat16),
                          torch.get_num_threads())
        if status != 0:
            raise MemoryError("paged_prefill_attention: no thread could allocate its buffer")


@functools.cache
def load_paged_prefill_kernel() -> PagedPrefillKernel | None:
    """The kernel, built on first use; None (logged once) where it cannot be built here."""
    try:
        return PagedPrefillKernel(built_library(SOURCE))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("CPU prefill-attention kernel not built (%s): prompts use SDPA", e)
        return None
