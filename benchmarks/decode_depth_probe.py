"""How many bytes per SM can a decode attention program keep in flight, and does it pay?

    python benchmarks/decode_depth_probe.py --out DIR          # on the GPU
    python benchmarks/decode_depth_probe.py --ir               # anywhere: compile for sm_90 only

Session 6 found (partition_probe.py) that our decode attention reads 25-33 GB/s per program, so
it needs two programs on every one of the 132 SMs to reach the HBM bandwidth, which rules out
giving the attention a third of the SMs and the GEMMs the rest. Compiling the split-KV kernel
for sm_90 (``--ir``) shows why: Triton's pipeliner gives the K and V tiles a single shared-memory
buffer at 2-4 stages (the block-table load in front of them takes the other stages), so each
iteration waits for its own tile; only 5 stages double-buffer them.

This probe times a persistent decode kernel (G programs looping over (request, kv head) items,
as in partition_probe.py) whose key loop loads the *next* tile's block ids one iteration ahead
(a loop-carried value, so the K/V loads no longer wait on a load of the same iteration), at
several pipeline depths, against the same loop without the prefetch, and with the 4 query heads
padded to 64 rows instead of 16 (Hopper's wgmma path, which double-buffers K/V either way), for G = 1/3 .. 2 programs
per SM on the batch-256, context-1500 decode (32 layers, 50.3 GB of KV). ``--ir`` prints each
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
import triton.language as tl

BATCH, CONTEXT, LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 256, 1500, 32, 32, 8, 128, 16
LOG2_E = 1.4426950408889634
REPS = 15
# (tile_n, num_warps, num_stages, block_m) of the variants; 64 query rows (4 heads padded)
# take Hopper's wgmma path, whose pipelining double-buffers K/V even without the prefetch
LAUNCHES = [(128, 4, 2, 16), (128, 4, 3, 16), (64, 4, 3, 16), (64, 4, 4, 16), (64, 4, 5, 16),
            (64, 4, 2, 64), (64, 4, 3, 64), (128, 4, 3, 64)]


@triton.jit
def _decode_kernel(
    out_ptr,  # [num_reqs, HEADS, HEAD_DIM]
    q_ptr,  # [num_reqs, HEADS, HEAD_DIM]
    key_cache_ptr,  # [num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM]
    value_cache_ptr,  # [num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM]
    block_table_ptr,  # int32 [num_reqs, max_blocks]
    seq_lens_ptr,  # int32 [num_reqs]
    num_items,  # num_reqs * KV_HEADS
    qk_scale,
    stride_block,
    stride_off,
    stride_bt,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    PREFETCH_IDS: tl.constexpr,  # load the next tile's block ids one iteration ahead
    BLOCK_M: tl.constexpr,  # q heads of one kv head, padded: 16 for tl.dot, 64 for wgmma
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, TILE_N)
    row_mask = offs_m < GROUP
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        req = item // KV_HEADS
        kv_head = item % KV_HEADS
        seq_len = tl.load(seq_lens_ptr + req)
        bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
        head = kv_head * GROUP + offs_m
        off = (req.to(tl.int64) * GROUP * KV_HEADS + head[:, None]) * HEAD_DIM + offs_d[None, :]
        q = tl.load(q_ptr + off, mask=row_mask[:, None], other=0.0)
        kc = key_cache_ptr + kv_head * HEAD_DIM
        vc = value_cache_ptr + kv_head * HEAD_DIM
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        ids = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=offs_n < seq_len, other=0)
        for start in range(0, seq_len, TILE_N):
            key_pos = start + offs_n
            key_mask = key_pos < seq_len
            if not PREFETCH_IDS:
                ids = tl.load(bt_row + key_pos // BLOCK_SIZE, mask=key_mask, other=0)
            row = ids.to(tl.int64) * stride_block + (key_pos % BLOCK_SIZE) * stride_off
            if PREFETCH_IDS:
                nxt = key_pos + TILE_N
                ids = tl.load(bt_row + nxt // BLOCK_SIZE, mask=nxt < seq_len, other=0)
            k = tl.load(kc + row[None, :] + offs_d[:, None], mask=key_mask[None, :], other=0.0)
            s = tl.dot(q, k) * qk_scale
            s = tl.where(key_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(vc + row[:, None] + offs_d[None, :], mask=key_mask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        tl.store(out_ptr + off, acc / l_i[:, None], mask=row_mask[:, None])


def launch(out, q, cache, block_table, seq_lens, programs: int, tile_n: int, warps: int,
           stages: int, prefetch: bool, block_m: int = 16) -> None:
    k, v = cache[0], cache[1]
    num_items = q.shape[0] * KV_HEADS
    _decode_kernel[(min(programs, num_items),)](
        out, q, k, v, block_table, seq_lens, num_items, HEAD_DIM**-0.5 * LOG2_E,
        k.stride(0), k.stride(1), block_table.stride(0),
        KV_HEADS=KV_HEADS, GROUP=HEADS // KV_HEADS, HEAD_DIM=HEAD_DIM, BLOCK_SIZE=BLOCK,
        TILE_N=tile_n, PREFETCH_IDS=prefetch, BLOCK_M=block_m, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip


def print_ir_depths() -> None:
    """Each variant compiled for sm_90 (no GPU needed): shared memory and K/V buffer depths."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _decode_kernel
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
        depths = sorted(set(re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x(\d+)x(\d+)x", ir)))
        print(f"t{tile_n} w{warps} s{stages} m{block_m} prefetch={prefetch}: shared "
              f"{kernel.metadata.shared} B, buffers (depth x rows x cols) {depths}", flush=True)


def time_variants(out_dir: Path) -> None:
    from graph_timing import COPY_BANDWIDTH, capture_graph, median_ms

    from pagedserve.kernels.paged_attention_split import paged_attention_split_kv

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks_per_req = CONTEXT // BLOCK + 1
    num_blocks = BATCH * blocks_per_req + 1
    caches = [torch.empty(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=dt, device=dev)
              .uniform_(-1, 1) for _ in range(LAYERS)]
    table = (torch.randperm(num_blocks - 1, device=dev) + 1)[: BATCH * blocks_per_req]
    table = table.view(BATCH, -1).int()
    seq_lens = torch.full((BATCH,), CONTEXT, dtype=torch.int32, device=dev)
    qsl = torch.arange(BATCH + 1, dtype=torch.int32, device=dev)
    q = torch.randn(BATCH, HEADS, HEAD_DIM, dtype=dt, device=dev)
    out, ref = torch.empty_like(q), torch.empty_like(q)  # [BATCH, HEADS, HEAD_DIM]
    kv_bytes = LAYERS * BATCH * CONTEXT * KV_HEADS * HEAD_DIM * 2 * 2
    paged_attention_split_kv(q, caches[0], table, qsl, seq_lens, BATCH, HEAD_DIM**-0.5, ref, 1)

    def engine() -> None:
        for cache in caches:
            paged_attention_split_kv(q, cache, table, qsl, seq_lens, BATCH, HEAD_DIM**-0.5, out, 1)

    report = {"sms": sms, "kv_bytes": kv_bytes,
              "engine_split_kv_ms": median_ms(capture_graph(engine).replay, REPS), "variants": []}
    print(f"engine split-KV kernel: {report['engine_split_kv_ms']:.2f} ms", flush=True)
    for variant, prefetch in [(x, p) for x in LAUNCHES for p in (False, True)]:
        tile_n, warps, stages, block_m = variant
        for per_sm in (1 / 3, 2 / 3, 1, 2):
            programs = max(1, round(sms * per_sm))
            def run(programs=programs, v=variant, p=prefetch) -> None:
                for cache in caches:
                    launch(out, q, cache, table, seq_lens, programs, *v[:3], p, v[3])
            try:
                launch(out, q, caches[0], table, seq_lens, programs, tile_n, warps, stages,
                       prefetch, block_m)
                err = (out.float() - ref.float()).abs().max().item()
                ms = median_ms(capture_graph(run).replay, REPS)
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
