"""The CPU's bf16 linear: ``cpu_gemv.c`` built once with the system C compiler (as the
native decode kernel, ``attention/backends/cpu_native``) and called through ctypes.

Why: a decode step at a small batch multiplies every weight by a few rows, so its time is the
weight read, and torch's bf16 linear at a few rows is slower than that; and on a CPU without native bf16 matmuls (no AVX512-BF16 or AMX) torch's bf16 matmul is
emulated, several times slower than its fp32 one, at any batch (docs/cpu.md#bf16-linears has
the figures). The kernel serves bf16 inputs (of up to ``SMALL_BATCH_ROWS`` rows where the CPU
has native bf16); everything else goes to ``F.linear``. No compiler, or a failed build:
``F.linear`` everywhere (logged once).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve.attention.backends.cpu_native import build, library_path
from pagedserve.platform import cpu_has_fast_bf16, default_cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_gemv.c")
SMALL_BATCH_ROWS = 4
"""Where the CPU multiplies bf16 natively, the rows of x the kernel takes; more go to
``F.linear``, whose native bf16 matmul is efficient once the weight serves many rows. Where it
does not, the kernel takes any number of rows."""

Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""(x [..., k], weight [n, k], bias [n] or None) -> [..., n], as ``F.linear``."""

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES: list[type[ctypes._SimpleCData]] = [_ptr] * 4 + [_i64] * 5 + [ctypes.c_int]


class GemvKernel:
    """``gemv_bf16`` of the built library as a drop-in ``F.linear`` for bf16 inputs of up to
    ``max_rows`` rows (None: any)."""

    def __init__(self, path: Path, max_rows: int | None) -> None:
        self.path = path
        self.max_rows = max_rows
        self._fn = ctypes.CDLL(str(path)).gemv_bf16
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = ctypes.c_int

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x  # [m, k]
        if not self.applies(rows, weight, bias):
            return F.linear(x, weight, bias)
        n = weight.shape[0]
        out = torch.empty((rows.shape[0], n), dtype=x.dtype)  # [m, n]
        status = self._fn(
            rows.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
            out.data_ptr(), rows.shape[0], n, weight.shape[1], rows.stride(0), n,
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("gemv_bf16: could not allocate the widened rows of x")
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)

    def applies(
        self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> bool:
        """The kernel's case: bf16 everywhere, 1..max_rows rows with k contiguous, a
        contiguous weight, not traced (a compiled graph keeps ``F.linear``)."""
        return (
            rows.is_cpu  # not meta (a model built for its shapes)
            and rows.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16
            and 0 < rows.shape[0] <= (self.max_rows or rows.shape[0])
            and rows.stride(-1) == 1
            and weight.is_contiguous()
            and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
            and not torch.compiler.is_compiling()
        )


@functools.cache
def cpu_linear() -> Linear:
    """The CPU's linear: the kernel where a C compiler builds it, else ``F.linear``."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.warning("no C compiler found: CPU bf16 linears use F.linear")
        return F.linear
    try:
        path = library_path(cc, default_cache_dir() / "cpu_kernels", SOURCE)
        if not path.exists():
            build(cc, path, SOURCE)
        return GemvKernel(path, SMALL_BATCH_ROWS if cpu_has_fast_bf16() else None)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("CPU bf16 GEMV kernel not built (%s): using F.linear", e)
        return F.linear
