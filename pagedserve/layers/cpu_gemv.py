"""The CPU's linear for few rows and emulated bf16: ``cpu_gemv.c`` built once with the system C
compiler (as the native decode kernel, ``attention/backends/cpu_native``) and called through
ctypes.

Why: a decode step at a small batch multiplies every weight by a few rows, so its time is the
weight read, and torch's linear at a few rows reads slower than that (bf16 and fp32); and on a
CPU without native bf16 matmuls (no AVX512-BF16 or AMX) torch's bf16 matmul is emulated,
several times slower than its fp32 one, at any batch (docs/cpu.md#bf16-linears has the
figures). Inputs of up to ``FEW_ROWS`` rows, bf16 or fp32, go to ``gemv_rows`` where
it is vectorized (AVX512F), or from ``PANEL_MIN_ROWS`` to ``PANEL_MAX_ROWS`` rows to
``gemm_panels`` on a copy of the weight packed in panels (``panel_gemm.h``); bf16 inputs of up
to ``SMALL_BATCH_ROWS`` rows (native bf16) or ``WIDENED_MIN_ROWS`` - 1 rows (emulated bf16) to
``gemv_bf16`` (AVX2); the rest to oneDNN on packed weights (``cpu_packed_linear.py``, which
multiplies emulated bf16 in fp32) where torch has it, else ``F.linear`` (then ``gemv_bf16``
takes every emulated bf16 input). No compiler, or a failed build: the same without the C
kernels (logged once).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve.attention.backends.cpu_native import built_library
from pagedserve.layers.cpu_packed_linear import PackedLinear, packing_available
from pagedserve.layers.linear import LinearBase
from pagedserve.layers.panel_pack import (
    PANEL_MAX_ROWS,
    PANEL_MIN_ROWS,
    panel_copies,
    panel_packable,
)
from pagedserve.platform.cpu import cpu_has_fast_bf16

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_gemv.c")
SMALL_BATCH_ROWS = 4
"""The rows of x ``gemv_bf16`` takes where the CPU multiplies bf16 natively; more go to
oneDNN, whose native bf16 matmul is efficient once the weight serves many rows."""
WIDENED_MIN_ROWS = 8
"""Where the CPU has no native bf16 matmul, bf16 inputs of this many rows or more go to oneDNN's
fp32 product on a widened copy of the weight (``PackedLinear``), fewer to ``gemv_bf16``, which
reads the bf16 weight (half the bytes) but multiplies slower from here on (default model's
linears, two threads: docs/cpu.md#bf16-linears)."""
FEW_ROWS = 8
"""The rows of x ``gemv_rows`` takes (bf16 or fp32): up to here it reads the weights faster
than torch's matmul (the default model's LM head and gate/up at 8 rows, one thread), at 16
torch is as fast or faster."""

Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""(x [..., k], weight [n, k], bias [n] or None) -> [..., n], as ``F.linear``."""

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES: list[type[ctypes._SimpleCData]] = [_ptr] * 4 + [_i64] * 5 + [ctypes.c_int]
_ROWS_ARGTYPES: list[type[ctypes._SimpleCData]] = [_ptr] * 4 + [_i64] * 5 + [ctypes.c_int] * 2


class GemvKernel:
    """The library's kernels as a drop-in ``F.linear``: ``gemm_panels`` (``PANEL_MIN_ROWS`` to
    ``PANEL_MAX_ROWS`` rows, where this build has its kernel for the dtype and the weight's
    panel copy fits the budget), ``gemv_rows`` (bf16 or fp32, up to ``FEW_ROWS`` rows) where it
    is vectorized here, ``gemv_bf16`` for the other bf16 inputs of up to ``max_rows`` rows
    (None: any), ``large`` for the rest."""

    def __init__(self, path: Path, max_rows: int | None, large: Linear = F.linear) -> None:
        self.path = path
        self.max_rows = max_rows
        self.large = large
        library = ctypes.CDLL(str(path))
        self._fn = library.gemv_bf16
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = ctypes.c_int
        self._rows_fn = library.gemv_rows
        self._rows_fn.argtypes = _ROWS_ARGTYPES
        self._rows_fn.restype = ctypes.c_int
        self._panels_fn = library.gemm_panels
        self._panels_fn.argtypes = _ROWS_ARGTYPES
        self._panels_fn.restype = ctypes.c_int
        self.rows_vectorized = bool(library.gemv_rows_vectorized())
        self.panel_dtypes = tuple(dtype for dtype in (torch.bfloat16, torch.float32)
                                  if library.gemm_panels_kernel(int(dtype == torch.bfloat16)))
        self.panels_widen_bf16 = bool(library.gemm_panels_widens_bf16())
        """bf16 weights' panels hold their fp32 values (no AVX512-BF16 here: panel_gemm.h)."""

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x  # [m, k]
        if not _plain(rows, weight, bias):
            return F.linear(x, weight, bias)
        panels = self._panels(rows, weight)
        few_rows = panels is None and self._few_rows(rows)
        if panels is None and not few_rows and not self._bf16_rows(rows):
            out = self.large(rows, weight, bias)  # [m, n]
            return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])
        n = weight.shape[0]
        out = torch.empty((rows.shape[0], n), dtype=x.dtype)  # [m, n]
        args = (rows.data_ptr(), weight.data_ptr() if panels is None else panels.data_ptr(),
                0 if bias is None else bias.data_ptr(), out.data_ptr(), rows.shape[0], n,
                weight.shape[1], rows.stride(0), n)
        threads, is_bf16 = torch.get_num_threads(), int(x.dtype == torch.bfloat16)
        if panels is not None:
            status = self._panels_fn(*args, is_bf16, threads)
        elif few_rows:
            status = self._rows_fn(*args, is_bf16, threads)
        else:
            status = self._fn(*args, threads)
        if status != 0:
            raise MemoryError("cpu_gemv: could not allocate the widened rows of x")
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)

    def _panels(self, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """The weight's panel copy where ``gemm_panels`` takes these (plain) rows, else None."""
        if not (PANEL_MIN_ROWS <= rows.shape[0] <= PANEL_MAX_ROWS
                and rows.dtype in self.panel_dtypes and panel_packable(weight)):
            return None
        return panel_copies().get(weight)

    def pack_panels(self, weight: torch.Tensor) -> None:
        """Make the weight's panel copy now (within the budget) where ``gemm_panels`` has a
        kernel for its dtype: ``_panels`` then finds it."""
        if weight.dtype in self.panel_dtypes and panel_packable(weight):
            panel_copies().get(weight)

    def applies(
        self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> bool:
        """``gemv_bf16``'s case: bf16 everywhere, 1..max_rows rows (see ``_plain``)."""
        return _plain(rows, weight, bias) and self._bf16_rows(rows)

    def takes_few_rows(
        self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> bool:
        """``gemv_rows``' case: vectorized here, bf16 or fp32, 1..FEW_ROWS rows."""
        return _plain(rows, weight, bias) and self._few_rows(rows)

    def _bf16_rows(self, rows: torch.Tensor) -> bool:  # of plain inputs
        return rows.dtype == torch.bfloat16 and 0 < rows.shape[0] <= (self.max_rows or rows.shape[0])

    def _few_rows(self, rows: torch.Tensor) -> bool:  # of plain inputs
        return (self.rows_vectorized and rows.dtype in (torch.bfloat16, torch.float32)
                and 0 < rows.shape[0] <= FEW_ROWS)


def _plain(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Not traced (a compiled graph keeps ``F.linear``; checked first: a traced row count is
    symbolic), on the CPU, weight and bias in the dtype of ``rows``, k contiguous, a contiguous
    weight."""
    return (
        not torch.compiler.is_compiling()
        and rows.is_cpu  # not meta (a model built for its shapes)
        and weight.dtype == rows.dtype
        and rows.stride(-1) == 1
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == rows.dtype and bias.is_contiguous()))
    )


@functools.cache
def cpu_linear() -> Linear:
    """The CPU's linear: the kernels where a C compiler builds them and oneDNN on packed
    weights for many rows, else whichever of the two is there, else ``F.linear``."""
    large = PackedLinear() if packing_available() else F.linear
    if cpu_has_fast_bf16():
        bf16_rows: int | None = SMALL_BATCH_ROWS
    else:
        bf16_rows = None if large is F.linear else WIDENED_MIN_ROWS - 1
    try:
        path = built_library(SOURCE)
        return GemvKernel(path, bf16_rows, large)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("CPU bf16 GEMV kernel not built (%s): using F.linear", e)
        return _unless_traced(large)


@functools.cache
def panels_widen_bf16() -> bool:
    """Whether this machine's panel copies of bf16 weights are widened to fp32: the C kernels
    are built and their panel product has no bf16 kernel (``panel_gemm.h``)."""
    linear = cpu_linear()
    return isinstance(linear, GemvKernel) and linear.panels_widen_bf16


def pack_panels(model: torch.nn.Module) -> None:
    """The panel copies of the weights that products of ``PANEL_MIN_ROWS`` rows or more read
    on panels: every linear layer's on this kernel (the C decode step's weights among them)
    and then the LM head's, so that a budget too small for all of them keeps the decoder
    layers' (read by every decode step)."""
    lm_head = getattr(model, "lm_head", None)
    for module in model.modules():
        kernel = getattr(module, "dense_linear", None)  # unquantized layers only
        if isinstance(module, LinearBase) and isinstance(kernel, GemvKernel):
            kernel.pack_panels(module.weight)
    if lm_head is not None and isinstance(getattr(lm_head, "dense_linear", None), GemvKernel):
        lm_head.dense_linear.pack_panels(lm_head.weight)


def _unless_traced(large: Linear) -> Linear:
    """``large`` for untraced 2-D CPU inputs, ``F.linear`` for the rest."""
    if large is F.linear:
        return large

    def linear(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or not _plain(x, weight, bias):
            return F.linear(x, weight, bias)
        return large(x, weight, bias)

    return linear
