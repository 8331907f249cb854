"""The CPU decode attention kernel on its own: a decode step's attention over every layer.

    python benchmarks/cpu_attention_bench.py [--requests 64] [--context 256,320]
        [--layers 30] [--dtype bfloat16] [--threads 1] [--reps 15]
        [--source A/paged_decode.c --source B/paged_decode.c]

Builds one paged KV cache per layer in the default model's attention shape (9 query heads,
3 KV heads of 64, 16-token blocks), each request's blocks scattered through its cache, contexts
uniform in the given range, random keys, values and queries; then calls the kernel
(``attention/backends/cpu_native``, as the attention backend and the C decode step run it)
once per layer, ``--reps`` times. Prints the min and median of the step's time and the KV bytes
read per second at the min. One cache per layer, as in the engine, so the keys and values come
from memory, not from a cache the previous layer warmed.

``--source`` (repeatable): build these copies of ``paged_decode.c``, each with the versions of
``paged_attention.h`` (and any other header) beside it, and alternate them rep by rep: the
machine's speed drifts, so versions are compared within one window.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from pagedserve.attention.backends.cpu_native import SOURCE, PagedDecodeKernel, built_library

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
K = TypeVar("K")


def paged_caches(layers: int, seq_lens: torch.Tensor, dtype: torch.dtype) -> list[tuple]:
    """Per layer: (kv_cache [2, blocks, BLOCK, KV_HEADS, HEAD_DIM], block_table int32 [R, n])
    with each request's blocks a random choice among the cache's."""
    per_req = int((seq_lens.max() + BLOCK - 1) // BLOCK)
    num_reqs = seq_lens.shape[0]
    out = []
    for _ in range(layers):
        blocks = num_reqs * per_req + 1  # block 0 is the null block
        cache = torch.randn(2, blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
        order = torch.randperm(blocks - 1)[: num_reqs * per_req] + 1
        out.append((cache, order.view(num_reqs, per_req).to(torch.int32).contiguous()))
    return out


def alternate_timings(kernels: list[K], step: Callable[[K], None], reps: int) -> list[list[float]]:
    """Seconds of ``step(kernel)`` per kernel, ``reps`` each after one untimed call, the kernels
    taking turns rep by rep: the machine's speed drifts, so versions share each window."""
    times: list[list[float]] = [[] for _ in kernels]
    for kernel in kernels:
        step(kernel)
    for _ in range(reps):
        for kernel, spent in zip(kernels, times, strict=True):
            start = time.perf_counter()
            step(kernel)
            spent.append(time.perf_counter() - start)
    return times


def add_timing_arguments(p: argparse.ArgumentParser, source_name: str) -> None:
    """The options both CPU attention benches take: layers, dtype, threads, reps, and the
    versions of the kernel's C source (``source_name``) to alternate."""
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--source", action="append", type=Path, default=None,
                   help=f"a copy of {source_name} to time (repeatable; default: the engine's)")


def add_decode_batch_arguments(p: argparse.ArgumentParser, source_name: str) -> None:
    """The decode batch (requests, their context range), then ``add_timing_arguments``."""
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--context", default="256,320", help="low,high: contexts uniform in it")
    add_timing_arguments(p, source_name)


def decode_seq_lens(args: argparse.Namespace) -> tuple[int, int, torch.Tensor]:
    """(low, high, seq_lens int32 [requests]): contexts uniform in ``--context``."""
    low, high = (int(v) for v in args.context.split(","))
    return low, high, torch.randint(low, high + 1, (args.requests,), dtype=torch.int32)


def print_timings(sources: list[Path], times: list[list[float]], unit: str) -> None:
    """Each source's min and median of its times (seconds), as ms ``unit``."""
    for source, spent in zip(sources, times, strict=True):
        print(f"  {source}: min {min(spent) * 1e3:.2f} ms, median "
              f"{statistics.median(spent) * 1e3:.2f} ms{unit}")


def start_timing(args: argparse.Namespace) -> torch.dtype:
    """Threads and seed as the options say; the dtype they name."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    return getattr(torch, args.dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_decode_batch_arguments(p, SOURCE.name)
    args = p.parse_args()
    sources = args.source or [SOURCE]
    kernels = [PagedDecodeKernel(built_library(s.resolve())) for s in sources]
    dtype = start_timing(args)
    low, high, seq_lens = decode_seq_lens(args)  # seq_lens int32 [R]
    layers = paged_caches(args.layers, seq_lens, dtype)
    query = torch.randn(args.requests, HEADS, HEAD_DIM).to(dtype)  # [R, HEADS, HEAD_DIM]
    output = torch.empty_like(query)
    rows = torch.arange(args.requests, dtype=torch.int64)  # [R]

    def step(kernel: PagedDecodeKernel) -> None:
        for cache, table in layers:
            kernel(query, cache, rows, table, seq_lens, HEAD_DIM**-0.5, output)

    times = alternate_timings(kernels, step, args.reps)
    kv_bytes = int(seq_lens.sum()) * KV_HEADS * HEAD_DIM * 2 * dtype.itemsize * args.layers
    print(f"{args.requests} request(s) at context {low}..{high}, {args.layers} layers, "
          f"{args.dtype}, {args.threads} thread(s):")
    for source, spent in zip(sources, times, strict=True):
        low_t, mid = min(spent), statistics.median(spent)
        print(f"  {source}: min {low_t * 1e3:.2f} ms, median {mid * 1e3:.2f} ms a step; "
              f"{kv_bytes / low_t / 1e9:.1f} GB/s of keys and values at the min")


if __name__ == "__main__":
    main()
