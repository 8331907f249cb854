"""The paged-attention kernels compiled for Hopper (sm_90) on this machine, no GPU needed: how
each launch reads its tiles, counted in the PTX.

    TRITON_INTERPRET=0 python benchmarks/attention_ptx.py [--kv-cache-dtype fp8|auto]
        [--kernel decode|prefill] [--json]

For each launch in ``LAUNCHES`` prints the shared-memory instructions of one compiled kernel at
Llama-3-8B's attention shape (32 query / 8 KV heads of 128, bf16 queries, 16-token blocks;
``pagedserve/kernels/attention_ptx.py``): byte loads (``ld.shared.b8``, an FP8 operand read
back one element at a time), other ``ld.shared``, ``st.shared``, ``ldmatrix`` (16-bit operands,
8x8 tiles at a time), async copies, and the tensor-core instructions (``mma`` for 16-row decode
tiles, ``wgmma`` for prefill tiles), with the shared memory a program takes. The counts are of
instructions in the code, not executed ones: they show which way the compiler staged a tile,
not its speed (``attention_sweep.py`` times them on the card). ``--json``: one JSON object per
launch instead of the table.
"""

from __future__ import annotations

import argparse
import json

import torch

from pagedserve.kernels.attention_ptx import HEAD_DIM, PATTERNS, compile_attention, ptx_counts
from pagedserve.kernels.paged_attention import KeyLoopLaunch

LAUNCHES = {
    "decode": [KeyLoopLaunch(t, w, s) for t, w, s in
               ((64, 4, 3), (128, 4, 1), (128, 4, 2), (128, 4, 3), (128, 8, 1))],
    "prefill": [KeyLoopLaunch(t, w, s, m) for t, w, s, m in
                ((64, 4, 2, 64), (64, 4, 3, 128), (64, 4, 1, 128))],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kv-cache-dtype", default="fp8", choices=("auto", "fp8"),
                        help="auto: bf16 (the model's dtype); fp8: float8_e4m3fn")
    parser.add_argument("--kernel", default="decode", choices=tuple(LAUNCHES))
    parser.add_argument("--json", action="store_true", help="one JSON object per launch")
    args = parser.parse_args()
    cache_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else torch.bfloat16
    launches = LAUNCHES[args.kernel]
    if not args.json:
        print("tile_n warps stages block_m | " + " ".join(PATTERNS) + " smem")
    for launch in launches:
        counts = ptx_counts(compile_attention(args.kernel, cache_dtype, launch))
        if args.json:
            print(json.dumps({"launch": vars(launch), **counts}), flush=True)
            continue
        print(f"{launch.tile(HEAD_DIM):6} {launch.num_warps:5} {launch.num_stages:6} "
              f"{launch.block_m or '-':>7} | "
              + " ".join(f"{counts[c]:{len(c)}}" for c in PATTERNS) + f" {counts['smem']}",
              flush=True)


if __name__ == "__main__":
    main()
