"""The CPU's native decode-attention kernel: ``paged_decode.c`` built once with the system C
compiler and called through ``ctypes``.

Why native: on the CPU, torch has no attention op that reads a paged cache, so the torch
reference gathers every decoding request's blocks into a padded copy and runs SDPA on it, and
its time goes to the gather and per-call overhead rather than to reading the keys and values.
The kernel reads them in place through the block table (docs/cpu.md#c-decode-kernel).

Built on first use into ``default_cache_dir() / "cpu_kernels"`` (or beforehand, with the
package's other C kernels, by ``build_all``), named by a hash of the source, the compiler
flags, the compiler and this CPU's feature flags (``-march=native`` code must not run on
another CPU). No compiler, or a failed build: the
caller gets ``None`` and keeps the torch path (the reason is logged once).

Threads: the kernel is OpenMP code linked against ``libgomp.so.1``; in a torch process that
soname resolves to the libgomp torch already loaded, so the kernel runs on torch's intra-op
threads; threads of its own would compete with torch's spinning workers
(docs/cpu.md#c-decode-kernel).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from pagedserve.platform import default_cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
"""-ffast-math for the compile step only: given to the link step, gcc links crtfastmath.o,
whose constructor sets flush-to-zero / denormals-are-zero for the whole process when the
library loads (torch's numerics included)."""
LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]
PACKAGE_DIR = Path(__file__).parents[3]
"""``pagedserve/``: each ``*.c`` under it is the source of one library."""
INCLUDE_DIRS = (Path(__file__).parent, PACKAGE_DIR / "layers")
"""Where the kernels' shared headers live (``paged_attention.h`` here, ``cpu_kernels.h`` in
``layers``): every source may include any of them, and every header's text is part of every
library's name, so editing a header rebuilds what includes it."""
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_ARGTYPES: list[type[ctypes._SimpleCData]] = [_ptr] * 7 + [_i64] * 9 + [ctypes.c_float, _i32, _i32]


@functools.cache
def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


@functools.cache
def _compiler_version(cc: str) -> str:
    return subprocess.run([cc, "--version"], capture_output=True, text=True).stdout


def _headers(source: Path) -> list[Path]:
    """Every header a build of ``source`` may include: those beside it first (the compiler
    looks there first, so a copy of a source can be built with other versions of them)."""
    folders = (source.parent, *(f for f in INCLUDE_DIRS if f.resolve() != source.parent.resolve()))
    return [header for folder in folders for header in sorted(folder.glob("*.h"))]


def library_path(cc: str, cache_dir: Path, source: Path = SOURCE) -> Path:
    """The library's file in ``cache_dir``, named by a hash of all it is built from."""
    key = hashlib.sha256()
    headers = [h.name.encode() + h.read_bytes() for h in _headers(source)]
    parts: tuple[bytes | str, ...] = (
        source.read_bytes(), *headers, " ".join(COMPILE_FLAGS + LINK_FLAGS), cc,
        _compiler_version(cc), _cpu_flags(), platform.machine())
    for part in parts:
        key.update(part if isinstance(part, bytes) else part.encode())
    return cache_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"


def build(cc: str, target: Path, source: Path = SOURCE) -> None:
    """Compile, then link in a separate step (see ``COMPILE_FLAGS``), into temporary files,
    then rename: a concurrent build never sees half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".tmp-") as tmp:
        obj, lib = os.path.join(tmp, f"{source.stem}.o"), os.path.join(tmp, target.name)
        includes = [f"-I{folder}" for folder in INCLUDE_DIRS]
        for cmd in ([cc, *COMPILE_FLAGS, *includes, "-c", str(source), "-o", obj],
                    [cc, obj, *LINK_FLAGS, "-o", lib]):  # fmt: skip
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{cc} failed: {result.stderr.strip()[-2000:]}")
        os.replace(lib, target)


def built_library(source: Path) -> Path:
    """``source`` built into the kernel cache (once; later calls find the file). OSError,
    RuntimeError or SubprocessError where no compiler builds it here."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found")
    path = library_path(cc, default_cache_dir() / "cpu_kernels", source)
    if not path.exists():
        build(cc, path, source)
    return path


def build_all(sources: list[Path] | None = None) -> dict[Path, str | None]:
    """Build the libraries of ``sources`` (default: every ``*.c`` of the package, each the
    source of one library) that are not built yet, all at once: each build is a compiler
    process, so on several cores they overlap. ``scripts/install.sh`` runs this (``python -m
    pagedserve.attention.backends.cpu_native``), and a CPU engine at start-up, so that a first
    start does not wait for the builds one after another. Returns source -> None (built, or
    found) or why it failed."""
    sources = sorted(PACKAGE_DIR.rglob("*.c")) if sources is None else sources

    def build_one(source: Path) -> str | None:
        try:
            built_library(source)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            return str(e)
        return None

    with ThreadPoolExecutor(max(len(sources), 1)) as pool:
        return dict(zip(sources, pool.map(build_one, sources), strict=True))


class PagedDecodeKernel:
    """``paged_decode_attention`` of the built library, with its argument types set."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fn = ctypes.CDLL(str(path)).paged_decode_attention
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = ctypes.c_int

    def __call__(
        self,
        query: torch.Tensor,  # [num_rows, Hq, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        rows: torch.Tensor,  # int64 [n]: the query/output row of each request
        block_table: torch.Tensor,  # int32 [n, >= max blocks]
        seq_lens: torch.Tensor,  # int32 [n]
        scale: float,
        output: torch.Tensor,  # [num_rows, Hq, D], written at ``rows``
    ) -> None:
        _check(query, kv_cache, rows, block_table, seq_lens, output)
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        status = self._fn(
            query.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
            rows.data_ptr(), block_table.data_ptr(), seq_lens.data_ptr(), output.data_ptr(),
            rows.shape[0], query.shape[1], num_kv_heads, head_dim, block_size,
            block_table.stride(0), query.stride(0), output.stride(0), kv_cache.stride(1),
            scale, int(query.dtype == torch.bfloat16), torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("paged_decode_attention: no thread could allocate its scratch")


def has_copy_for(dtype: torch.dtype, *others: torch.dtype) -> bool:
    """Whether the kernel has a compiled copy for ``dtype`` and every tensor shares it."""
    return dtype in SUPPORTED_DTYPES and all(other == dtype for other in others)


def heads_packed(x: torch.Tensor) -> bool:
    """[rows, heads, head_dim] with head_dim contiguous and the heads back to back (any row
    stride): the layout the kernel indexes."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _check(query, kv_cache, rows, block_table, seq_lens, output) -> None:  # noqa: ANN001
    """The kernel trusts its pointers: everything it assumes is checked here."""
    if not has_copy_for(query.dtype, kv_cache.dtype, output.dtype):
        raise ValueError(f"query/kv_cache/output: dtypes {query.dtype}/{kv_cache.dtype}/"
                         f"{output.dtype}; one of {SUPPORTED_DTYPES} for all three")  # fmt: skip
    if not (heads_packed(query) and heads_packed(output)) or output.shape != query.shape:
        raise ValueError("query/output: [rows, heads, head_dim] with heads and head_dim packed")
    if not kv_cache[0, 0].is_contiguous():
        raise ValueError("kv_cache: each block must be contiguous [block_size, Hkv, D]")
    if query.shape[1] % kv_cache.shape[3] != 0 or query.shape[2] != kv_cache.shape[4]:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit kv_cache {tuple(kv_cache.shape)}"
        )
    n = rows.shape[0]
    if (rows.dtype, block_table.dtype, seq_lens.dtype) != (torch.int64, torch.int32, torch.int32):
        raise ValueError("rows/block_table/seq_lens: expected int64/int32/int32")
    if block_table.shape[0] != n or seq_lens.shape != (n,) or block_table.stride(1) != 1 \
            or not rows.is_contiguous() or not seq_lens.is_contiguous():  # fmt: skip
        raise ValueError("rows/block_table/seq_lens: one contiguous row per request")


@functools.cache
def load_paged_decode_kernel() -> PagedDecodeKernel | None:
    """The kernel, built on first use; None (logged once) when it cannot be built here."""
    try:
        return PagedDecodeKernel(built_library(SOURCE))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("CPU decode-attention kernel not built (%s): using the torch path", e)
        return None
