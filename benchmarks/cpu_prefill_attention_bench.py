"""The CPU prefill attention kernel on its own: a prefill step's attention over every layer.

    python benchmarks/cpu_prefill_attention_bench.py [--prompts 8] [--prompt-len 256]
        [--prefix 0] [--layers 30] [--dtype bfloat16] [--threads 1] [--reps 15]
        [--source A.c --source B.c]

Builds one paged KV cache per layer in the default model's attention shape (9 query heads,
3 KV heads of 64, 16-token blocks), each prompt's blocks scattered through its cache, random
keys, values and queries; then calls the kernel (``cpu_native/prefill.py``, as the CPU
attention backend runs it) once per layer, ``--reps`` times. ``--prefix`` cached tokens
before each prompt make it a chunk after a cached prefix. Prints the min and median of the
step's time and the causal QK^T + PV FLOP rate at each.

``--source`` (repeatable): build these versions of ``paged_prefill.c`` (kept beside the engine's,
so that its headers resolve) and alternate them rep by rep: the machine's speed drifts, so
versions are compared within one window.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from cpu_attention_bench import (
    HEAD_DIM,
    HEADS,
    add_timing_arguments,
    alternate_timings,
    paged_caches,
    start_timing,
)

from pagedserve.attention.backends.cpu_native import built_library
from pagedserve.attention.backends.cpu_native.prefill import (
    SOURCE,
    PagedPrefillKernel,
)


def causal_flops(prompts: int, prompt_len: int, prefix: int) -> int:
    """QK^T and PV multiply-adds (2 FLOPs each) of every query head over the keys it sees."""
    pairs = sum(prefix + i + 1 for i in range(prompt_len))  # (row, key) pairs per head
    return prompts * HEADS * pairs * HEAD_DIM * 2 * 2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--prefix", type=int, default=0, help="cached tokens before each prompt")
    add_timing_arguments(p, SOURCE.name)
    args = p.parse_args()
    sources = args.source or [SOURCE]
    kernels = [PagedPrefillKernel(built_library(s.resolve())) for s in sources]
    dtype = start_timing(args)
    seq_len, rows = args.prefix + args.prompt_len, args.prompts * args.prompt_len
    layers = paged_caches(args.layers, torch.full((args.prompts,), seq_len), dtype)
    query = torch.randn(rows, HEADS, HEAD_DIM).to(dtype)  # [rows, HEADS, HEAD_DIM]
    output = torch.empty_like(query)
    reqs = torch.tensor([[i * args.prompt_len, args.prompt_len, seq_len, i]
                         for i in range(args.prompts)], dtype=torch.int64)  # [P, 4]

    def step(kernel: PagedPrefillKernel) -> None:
        for cache, table in layers:
            kernel(query, cache, table, reqs, HEAD_DIM**-0.5, output)

    times = alternate_timings(kernels, step, args.reps)
    flops = causal_flops(args.prompts, args.prompt_len, args.prefix) * args.layers
    print(f"{args.prompts} prompt(s) of {args.prompt_len} after {args.prefix} cached, "
          f"{args.layers} layers, {args.dtype}, {args.threads} thread(s), "
          f"{flops / 1e9:.2f} GFLOP a step:")
    for source, spent in zip(sources, times, strict=True):
        low, mid = min(spent), statistics.median(spent)
        print(f"  {source}: min {low * 1e3:.2f} ms, median {mid * 1e3:.2f} ms a step; "
              f"{flops / low / 1e9:.1f} / {flops / mid / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
