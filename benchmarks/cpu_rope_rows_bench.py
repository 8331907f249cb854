"""The CPU's rotary + KV-write rows of a prompt step on their own (``rope_write_kv_rows``,
``layers/cpu_rows.c``), every layer of the default model.

    python benchmarks/cpu_rope_rows_bench.py [--rows 2048] [--layers 30] [--dtype bfloat16]
        [--threads 1] [--reps 15] [--source A/cpu_rows.c --source B/cpu_rows.c]

Per layer, as the attention layer hands them over: q, k, v split from one qkv row [rows, (9 +
2 x 3) x 64] of the layer's own, each row's cos | sin [rows, 64], and the layer's paged KV
cache, the rows' slots filling its blocks in a random order (prompts of 256 tokens). Calls
the kernel for every layer, ``--reps`` times, and prints the min and median of the whole.

``--source`` (repeatable): build these copies of ``cpu_rows.c``, each with the versions of the
headers beside it (copy ``layers/*.h`` there), and alternate them rep by rep.
"""

from __future__ import annotations

import argparse
import ctypes

import torch
from cpu_attention_bench import (
    BLOCK,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    add_timing_arguments,
    alternate_timings,
    print_timings,
    start_timing,
)

from pagedserve.layers.cpu_rows import SOURCE, RopeRows, library_of


def layer_rows(rows: int, cos_sin: torch.Tensor, slots: torch.Tensor,
               dtype: torch.dtype) -> tuple[RopeRows, list[torch.Tensor]]:
    """One layer's kernel arguments and the tensors they point into (kept alive)."""
    hq, hkv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv = torch.randn(rows, hq + 2 * hkv).to(dtype)  # [rows, (Hq + 2 Hkv) D]
    q, k, v = qkv.split([hq, hkv, hkv], dim=-1)
    num_blocks = -(-rows // BLOCK)
    cache = torch.zeros(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    out = torch.empty(rows, hq, dtype=dtype)  # [rows, Hq D]
    args = RopeRows(q.data_ptr(), k.data_ptr(), v.data_ptr(), cos_sin.data_ptr(),
                    slots.data_ptr(), out.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(),
                    rows, HEADS, KV_HEADS, HEAD_DIM, BLOCK, cache.stride(1),
                    qkv.stride(0), qkv.stride(0), qkv.stride(0))
    return args, [qkv, cache, out]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=2048)
    add_timing_arguments(p, SOURCE.name)
    args = p.parse_args()
    sources = args.source or [SOURCE]
    libs = [library_of(s.resolve()) for s in sources]
    dtype = start_timing(args)
    cos_sin = torch.randn(args.rows, HEAD_DIM).to(dtype)  # [rows, D]
    blocks = torch.randperm(-(-args.rows // BLOCK))
    positions = torch.arange(args.rows)
    slots = (blocks[positions // BLOCK] * BLOCK + positions % BLOCK).to(torch.int64)  # [rows]
    layers = [layer_rows(args.rows, cos_sin, slots, dtype) for _ in range(args.layers)]
    is_bf16 = int(dtype == torch.bfloat16)

    def step(lib: ctypes.CDLL) -> None:
        for rows, _ in layers:
            if lib.rope_write_kv_rows(ctypes.byref(rows), is_bf16, args.threads) != 0:
                raise MemoryError("rope_write_kv_rows: no row buffer")

    times = alternate_timings(libs, step, args.reps)
    print(f"{args.rows} rows, {args.layers} layers, {args.dtype}, {args.threads} thread(s):")
    print_timings(sources, times, "")


if __name__ == "__main__":
    main()
