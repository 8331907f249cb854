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

``--tma`` times ``decode_tma.py``'s kernel instead (each cache block's K and V as TMA copies,
``(stages - 1) x blocks per iteration`` blocks in flight per program; sm_90 compile: 7 deep,
62 KB of shared memory at 8 stages and one block per iteration) at 1/3 .. 3 programs per SM, and writes ``decode_depth_probe_tma.json``;
with ``--ir``, its sm_90 buffer depths and TMA copy counts.

``--l2-ahead N ...`` times ``decode_batch.py``'s kernel (block ids a tile ahead) with the K/V
lines of the tile N tiles ahead prefetched to L2 (``prefetch.global.L2``; 0: none) at 1/3 .. 2
programs per SM, and writes ``decode_depth_probe_l2.json``: a prefetch keeps bytes in flight
without holding registers or shared memory, so a program's read rate is no longer bounded by
its buffers, only by the latency of L2 hits. ``--swapped`` times ``decode_swapped.py``'s
kernel (keys and head dimension as the dots' M side, on wgmma) the same way and writes
``decode_depth_probe_swapped.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from collections.abc import Callable
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
from decode_swapped import launch_swapped
from decode_tma import launch_tma, persistent_decode_tma_kernel

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


# (num_warps, num_stages, cache blocks per iteration) by cache block size (tokens): a 16-token
# block is 8 KB of K and V per kv head, a 64-token one 32 KB, a 128-token one 64 KB per stage
TMA_LAUNCHES = {16: [(4, 4, 1), (4, 6, 1), (4, 8, 1), (8, 8, 1), (4, 3, 2), (4, 4, 2), (4, 3, 4)],
                64: [(4, 3, 1), (4, 4, 1), (4, 6, 1), (8, 4, 1)],
                128: [(4, 2, 1), (4, 3, 1), (8, 3, 1)]}
TMA_PER_SM = (1 / 3, 2 / 3, 1, 2, 3)


def print_tma_ir(block_size: int) -> None:
    """The TMA kernel's sm_90 compile per launch: shared memory, K/V buffer depth, copies."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = persistent_decode_tma_kernel
    names = [p.name for p in fn.params]
    constexprs = dict(KV_HEADS=KV_HEADS, GROUP=HEADS // KV_HEADS, HEAD_DIM=HEAD_DIM,
                      BLOCK_SIZE=block_size, BLOCK_M=16, BLOCKS_PER_ITER=1)
    sig = {n: "constexpr" if n in constexprs else "*bf16" if n.endswith("_ptr") else "i32"
           for n in names}
    desc = f"tensordesc<bf16[{block_size}, {HEAD_DIM}]>"
    sig.update(block_table_ptr="*i32", seq_lens_ptr="*i32", qk_scale="fp32", k_desc=desc,
               v_desc=desc)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n.endswith("_ptr")}
    for warps, stages, blocks in TMA_LAUNCHES[block_size]:
        kernel = triton.compile(ASTSource(fn, sig, constexprs={**constexprs,
                                                               "BLOCKS_PER_ITER": blocks},
                                          attrs=attrs),
                                target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=warps, num_stages=stages))
        depths = re.findall(rf"local_alloc : \(\) -> !ttg.memdesc<(\d+)x{block_size}x",
                            kernel.asm["ttgir"])
        copies = kernel.asm["ptx"].count("cp.async.bulk.tensor")
        print(f"tma w{warps} s{stages} b{blocks}: shared {kernel.metadata.shared} B, K/V "
              f"buffers {len(depths)} of depth {sorted(set(depths))}, TMA copy instructions "
              f"{copies}", flush=True)


def _setup(block_size: int = BLOCK) -> tuple[DecodeBatch, torch.Tensor, dict]:
    """The decode batch, the engine kernel's output on its layer 0 (the reference) and the
    report's head (with the engine kernel's time over the 32 layers)."""
    from graph_timing import graph_time_ms

    from pagedserve.kernels.paged_attention_split import paged_attention_split_kv

    torch.manual_seed(0)
    batch = DecodeBatch(block_size)
    ref = torch.empty_like(batch.q)  # [DECODE_BATCH, HEADS, HEAD_DIM]
    paged_attention_split_kv(batch.q, batch.caches[0], batch.block_table, batch.query_start_loc,
                             batch.seq_lens, DECODE_BATCH, HEAD_DIM**-0.5, ref, 1)
    report = {"sms": torch.cuda.get_device_properties(0).multi_processor_count,
              "block_size": block_size,
              "kv_bytes": batch.kv_bytes,
              "engine_split_kv_ms": graph_time_ms(batch.engine(1), REPS), "variants": []}
    print(f"engine split-KV kernel: {report['engine_split_kv_ms']:.2f} ms", flush=True)
    return batch, ref, report


def _measure(batch: DecodeBatch, ref: torch.Tensor, report: dict, label: str, fields: dict,
             once: Callable[[], None], run: Callable[[], None]) -> bool:
    """``once`` (layer 0, checked against ``ref``), then ``run`` (32 layers) timed in a graph;
    the row goes to ``report``. False when the launch fails (shared memory)."""
    from graph_timing import COPY_BANDWIDTH, graph_time_ms

    try:
        once()
        err = (batch.out.float() - ref.float()).abs().max().item()
        ms = graph_time_ms(run, REPS)
    except Exception as e:  # noqa: BLE001 - a launch that does not fit shared memory
        print(f"  {label}: {e}"[:200], flush=True)
        return False
    kv_bytes, programs = report["kv_bytes"], fields["programs"]
    row = {**fields, "ms": ms, "max_err": err,
           "of_copy_bw": kv_bytes / (ms * 1e-3) / COPY_BANDWIDTH,
           "gb_s_per_busy_sm": kv_bytes / (ms * 1e-3) / min(programs, report["sms"]) / 1e9}
    report["variants"].append(row)
    print(f"  {label}: {ms:.2f} ms ({row['of_copy_bw']:.2f} of copy bw, "
          f"{row['gb_s_per_busy_sm']:.0f} GB/s per busy SM, err {err:.2g})", flush=True)
    return True


# (tile_n, num_warps, num_stages) of the L2-prefetch sweep, block ids a tile ahead
L2_LAUNCHES = [(64, 4, 3), (128, 4, 2), (64, 4, 2)]
# (tile_n, num_warps, num_stages) of the swapped kernel (decode_swapped.py)
SWAPPED_LAUNCHES = [(64, 4, 2), (64, 4, 3), (128, 4, 2), (64, 8, 3), (128, 8, 2)]
PER_SM = (1 / 3, 2 / 3, 1, 2)
Variant = tuple[str, dict, Callable[[DecodeBatch, int], None],
                Callable[[DecodeBatch, int], Callable[[], None]]]
"""(label, fields, launch(batch, programs) on layer 0, run(batch, programs) over 32 layers)."""


def _sweep(out_dir: Path, name: str, variants: list[Variant],
           per_sm_counts: tuple[float, ...] = PER_SM,
           block_size: int = BLOCK) -> None:
    """Each variant at ``per_sm_counts`` programs per SM (a count whose launch fails ends the
    variant); the report goes to ``out_dir / name`` after each variant."""
    batch, ref, report = _setup(block_size)
    for label, fields, once, run in variants:
        for per_sm in per_sm_counts:
            programs = max(1, round(report["sms"] * per_sm))
            if not _measure(batch, ref, report, f"{label} G={programs}",
                            {**fields, "programs": programs},
                            functools.partial(once, batch, programs), run(batch, programs)):
                break
        (out_dir / name).write_text(json.dumps(report, indent=1))


def _gathered(tile_n: int, warps: int, stages: int, prefetch: bool, block_m: int, ahead: int,
              label: str, fields: dict) -> Variant:
    """``decode_batch.launch``'s kernel at one launch shape."""
    def once(b: DecodeBatch, programs: int) -> None:
        launch(b.out, b.q, b.caches[0], b.block_table, b.seq_lens, programs, tile_n, warps,
               stages, prefetch, block_m, ahead)
    return (label, fields, once, lambda b, programs: b.persistent(
        programs, tile_n, warps, stages, prefetch, block_m, ahead))


def time_tma(out_dir: Path, block_size: int) -> None:
    def variant(warps: int, stages: int, blocks: int) -> Variant:
        def once(b: DecodeBatch, programs: int) -> None:
            launch_tma(b.out, b.q, b.caches[0], b.block_table, b.seq_lens, programs, warps,
                       stages, blocks)
        return (f"tma w{warps} s{stages} b{blocks}",
                {"warps": warps, "stages": stages, "blocks_per_iter": blocks}, once,
                lambda b, programs: b.persistent_tma(programs, warps, stages, blocks))
    name = "decode_depth_probe_tma.json" if block_size == BLOCK else \
        f"decode_depth_probe_tma_b{block_size}.json"
    _sweep(out_dir, name, [variant(*x) for x in TMA_LAUNCHES[block_size]], TMA_PER_SM,
           block_size)


def time_l2_ahead(out_dir: Path, aheads: list[int]) -> None:
    _sweep(out_dir, "decode_depth_probe_l2.json", [
        _gathered(t, w, s, True, 16, a, f"t{t} w{w} s{s} l2_ahead={a}",
                  {"tile_n": t, "warps": w, "stages": s, "l2_ahead": a})
        for t, w, s in L2_LAUNCHES for a in aheads])


def time_swapped(out_dir: Path) -> None:
    def variant(tile_n: int, warps: int, stages: int) -> Variant:
        def once(b: DecodeBatch, programs: int) -> None:
            launch_swapped(b.out, b.q, b.caches[0], b.block_table, b.seq_lens, programs, tile_n,
                           warps, stages)

        def run(b: DecodeBatch, programs: int) -> Callable[[], None]:
            return lambda: [launch_swapped(b.out, b.q, cache, b.block_table, b.seq_lens,
                                           programs, tile_n, warps, stages) for cache in b.caches]
        return (f"swapped t{tile_n} w{warps} s{stages}",
                {"tile_n": tile_n, "warps": warps, "stages": stages}, once, run)
    _sweep(out_dir, "decode_depth_probe_swapped.json", [variant(*x) for x in SWAPPED_LAUNCHES])


def time_variants(out_dir: Path) -> None:
    _sweep(out_dir, "decode_depth_probe.json", [
        _gathered(t, w, s, p, m, 0, f"t{t} w{w} s{s} m{m} prefetch={p}",
                  {"tile_n": t, "warps": w, "stages": s, "block_m": m, "prefetch": p})
        for (t, w, s, m), p in [(x, p) for x in LAUNCHES for p in (False, True)]])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--ir", action="store_true", help="print sm_90 buffer depths and stop")
    parser.add_argument("--tma", action="store_true", help="the TMA kernel's variants instead")
    parser.add_argument("--block-size", type=int, choices=sorted(TMA_LAUNCHES), default=BLOCK,
                        help="with --tma: the cache block size (one TMA copy per block)")
    parser.add_argument("--swapped", action="store_true",
                        help="decode_swapped.py's kernel (keys as the dots' M side) instead")
    parser.add_argument("--l2-ahead", type=int, nargs="+", metavar="N",
                        help="the L2-prefetch sweep at these distances (tiles) instead")
    args = parser.parse_args()
    if args.ir:
        if args.tma:
            print_tma_ir(args.block_size)
        else:
            print_ir_depths()
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tma:
        time_tma(args.out, args.block_size)
    elif args.l2_ahead:
        time_l2_ahead(args.out, args.l2_ahead)
    elif args.swapped:
        time_swapped(args.out)
    else:
        time_variants(args.out)


if __name__ == "__main__":
    main()
