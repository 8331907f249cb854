"""How many bytes per SM can a decode attention program keep in flight, and does it pay?

    python benchmarks/decode_depth_probe.py --out DIR          # on the GPU
    python benchmarks/decode_depth_probe.py --ir               # anywhere: compile for sm_90 only

Session 6 found (partition_probe.py) that our decode attention reads 25-33 GB/s per program, so
it needs two programs on every one of the 132 SMs to reach the HBM bandwidth, which rules out
giving the attention a third of the SMs and the GEMMs the rest. Compiling the split-KV kernel
for sm_90 (``--ir``) shows why: Triton's pipeliner gives the K and V tiles a single shared-memory
buffer at 2-4 stages (the block-table load in front of them takes the other stages), so each
iteration waits for its own tile; only 5 stages double-buffer them.

This probe times ``decode_batch.py``'s persistent decode kernel (G programs looping over
(request, kv head) items) with its key loop loading the *next* tile's block ids one iteration
ahead (a loop-carried value, so the K/V loads no longer wait on a load of the same iteration),
at several pipeline depths, against the same loop without the prefetch, and with the 4 query
heads padded to 64 rows instead of 16 (Hopper's wgmma path, which double-buffers K/V either
way), for G = 1/3 .. 2 programs per SM on the batch-256, context-1500 decode (32 layers, 50.3
GB of KV). ``--ir`` prints each
variant's shared memory and K/V buffer depth from the sm_90 compile (no GPU needed: Triton
ships ptxas). Writes ``decode_depth_probe.json``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
import triton
from decode_batch import (
    BLOCK,
    DECODE_BATCH,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    DecodeBatch,
    launch,
    persistent_decode_kernel,
)

REPS = 15
# (tile_n, num_warps, num_stages, block_m) of the variants; 64 query rows (4 heads padded)
# take Hopper's wgmma path, whose pipelining double-buffers K/V even without the prefetch;
# 8 warps: twice the warps issuing one program's dots and softmax (session 7: a 4-warp program
# read at most 31 GB/s with two or three K/V tiles in flight, while two programs per SM read
# twice as much; the per-tile instruction chain is the suspect, the warp count the test)
LAUNCHES = [(128, 4, 2, 16), (128, 4, 3, 16), (64, 4, 3, 16), (64, 4, 4, 16), (64, 4, 5, 16),
            (64, 4, 2, 64), (64, 4, 3, 64), (128, 4, 3, 64), (128, 8, 3, 16), (64, 8, 4, 16)]


def print_ir_depths() -> None:
    """Each variant compiled for sm_90 (no GPU needed): shared memory and K/V buffer depths."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = persistent_decode_kernel
    names = [p.name for p in fn.params]
    for (tile_n, warps, stages, block_m), prefetch in [(x, p) for x in LAUNCHES
                                                       for p in (False, True)]:
        constexprs = dict(KV_HEADS=KV_HEADS, GROUP=HEADS // KV_HEADS, HEAD_DIM=HEAD_DIM,
                          BLOCK_SIZE=BLOCK, TILE_N=tile_n, PREFETCH_IDS=prefetch,
                          BLOCK_M=block_m)
        sig = {n: "constexpr" if n in constexprs else "*bf16" if n.endswith("_ptr") else "i32"
               for n in names}
        sig.update(block_table_ptr="*i32", seq_lens_ptr="*i32", qk_scale="fp32")
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                 if n.endswith("_ptr") or n.startswith("stride_")}
        kernel = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs),
                                target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=warps, num_stages=stages))
        ir = kernel.asm["ttgir"]
        buffers = r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x(\d+)x(\d+)x"
        depths = sorted(set(re.findall(buffers, ir)))
        print(f"t{tile_n} w{warps} s{stages} m{block_m} prefetch={prefetch}: shared "
              f"{kernel.metadata.shared} B, buffers (depth x rows x cols) {depths}", flush=True)


def time_variants(out_dir: Path) -> None:
    from graph_timing import COPY_BANDWIDTH, graph_time_ms

    from pagedserve.kernels.paged_attention_split import paged_attention_split_kv

    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = DecodeBatch()
    q, cache0, table, seq_lens = batch.q, batch.caches[0], batch.block_table, batch.seq_lens
    kv_bytes = batch.kv_bytes
    ref = torch.empty_like(q)  # [DECODE_BATCH, HEADS, HEAD_DIM]: the engine kernel, layer 0
    paged_attention_split_kv(q, cache0, table, batch.query_start_loc, seq_lens, DECODE_BATCH,
                             HEAD_DIM**-0.5, ref, 1)

    report = {"sms": sms, "kv_bytes": kv_bytes,
              "engine_split_kv_ms": graph_time_ms(batch.engine(1), REPS),
              "variants": []}
    print(f"engine split-KV kernel: {report['engine_split_kv_ms']:.2f} ms", flush=True)
    for variant, prefetch in [(x, p) for x in LAUNCHES for p in (False, True)]:
        tile_n, warps, stages, block_m = variant
        for per_sm in (1 / 3, 2 / 3, 1, 2):
            programs = max(1, round(sms * per_sm))
            try:
                launch(batch.out, q, cache0, table, seq_lens, programs, tile_n, warps, stages,
                       prefetch, block_m)
                err = (batch.out.float() - ref.float()).abs().max().item()
                run = batch.persistent(programs, tile_n, warps, stages, prefetch, block_m)
                ms = graph_time_ms(run, REPS)
            except Exception as e:  # noqa: BLE001 - a shape that does not fit shared memory
                print(f"  {variant} prefetch={prefetch}: {e}"[:200], flush=True)
                break
            gbps_per_sm = kv_bytes / (ms * 1e-3) / min(programs, sms) / 1e9
            row = {"tile_n": tile_n, "warps": warps, "stages": stages, "block_m": block_m,
                   "prefetch": prefetch, "programs": programs, "ms": ms, "max_err": err,
                   "of_copy_bw": kv_bytes / (ms * 1e-3) / COPY_BANDWIDTH,
                   "gb_s_per_busy_sm": gbps_per_sm}
            report["variants"].append(row)
            print(f"  t{tile_n} w{warps} s{stages} m{block_m} prefetch={prefetch} G={programs}: "
                  f"{ms:.2f} ms "
                  f"({row['of_copy_bw']:.2f} of copy bw, {gbps_per_sm:.0f} GB/s per busy SM, "
                  f"err {err:.2g})", flush=True)
        (out_dir / "decode_depth_probe.json").write_text(json.dumps(report, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--ir", action="store_true", help="print sm_90 buffer depths and stop")
    args = parser.parse_args()
    if args.ir:
        print_ir_depths()
        return
    args.out.mkdir(parents=True, exist_ok=True)
    time_variants(args.out)


if __name__ == "__main__":
    main()
