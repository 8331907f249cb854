"""Launch shapes of the paged attention kernels, timed on their own (Llama-3-8B attention).

    python benchmarks/attention_sweep.py --out DIR [--scenarios b64,b256,p8x1024,p4x2048]

Decode batches of the headline workloads (b64: 64 requests at context 1024, the batch-64 step;
b256: 256 at 1500, the middle of 1000 x 1000/1000's decode; b256r: 256 at contexts uniform in
1000..2000, as that decode sees them; b16 and b128 at 1024) and prefill steps (p8x1024: 8 prompts
of 1024 tokens, one step of 1000 x 1000/1000's prefill; p4x2048: one of 1000 x 2048/128's; p2x8192
and p1x16384: long prompts), bf16 paged KV cache (FP8 with ``--kv-cache-dtype fp8``; ``--block-
size``, default 16, shuffled block tables), 32 query / 8 KV heads of 128. Decode: the varlen kernel
(splits 0 below) and the split-KV kernel at 1, 2 and 4 splits, every key-tile size, warp count and
pipeline depth listed below, as KV bytes read per second against the card's copy bandwidth.
Prefill: the varlen kernel with query tiles of 64 and 128 rows, as causal attention FLOPs per
second against the bf16 matmul peak. Each: median of 15 replays of a CUDA graph of 10 launches.
Writes ``attention_sweep.json`` and ``best.json`` (the fastest shape per scenario). The launches
the engine uses (``attention/backends/triton.py``: ``SPLIT_KV_LAUNCH``, ``FEW_PAIRS_LAUNCH``,
``PREFILL_LAUNCH``) are this sweep's winners.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.entrypoints.bench.graph_timing import graph_time_ms
from pagedserve.entrypoints.bench.roofline import MEASURED_CEILINGS
from pagedserve.kernels.paged_attention import DEFAULT_LAUNCH, KeyLoopLaunch, paged_attention
from pagedserve.kernels.paged_attention_split import paged_attention_split_kv

COPY_BANDWIDTH, MATMUL_PEAK = MEASURED_CEILINGS["H200"]
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
# requests, context (a pair: uniform in that range)
DECODE = {"b64": (64, 1024), "b256": (256, 1500), "b256r": (256, (1000, 2000)),
          "b16": (16, 1024), "b128": (128, 1024)}
# prompts, prompt length (p2x8192, p1x16384: long-context prompts, whole in one launch)
PREFILL = {"p8x1024": (8, 1024), "p4x2048": (4, 2048), "p2x8192": (2, 8192),
           "p1x16384": (1, 16384)}


def graph_us(fn, launches: int = 10, reps: int = 15) -> float:
    """us per launch: a graph of ``launches`` calls of ``fn``, median of ``reps`` replays."""
    return graph_time_ms(lambda: [fn() for _ in range(launches)], reps) * 1e3 / launches


def paged_batch(num_reqs: int, query_len: int, context, block_size: int = BLOCK,
                cache_dtype: torch.dtype = torch.bfloat16, dev: str = "cuda") -> dict:
    """``num_reqs`` requests of ``query_len`` new tokens each at ``context`` tokens (the new
    ones included; a (low, high) pair: uniform in it), random keys and values in shuffled
    cache blocks."""
    if isinstance(context, tuple):
        seq_lens = torch.randint(context[0], context[1] + 1, (num_reqs,), device=dev)
    else:
        seq_lens = torch.full((num_reqs,), context, device=dev)
    blocks_per_req = -(-int(seq_lens.max()) // block_size)
    num_blocks = num_reqs * blocks_per_req + 1
    table = (torch.randperm(num_blocks - 1, device=dev) + 1).view(num_reqs, blocks_per_req)
    num_tokens = num_reqs * query_len
    return dict(
        query=torch.randn(num_tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev),
        kv_cache=torch.randn(2, num_blocks, block_size, KV_HEADS, HEAD_DIM,
                             dtype=torch.bfloat16, device=dev).to(cache_dtype),
        block_table=table.to(torch.int32),
        query_start_loc=torch.arange(0, num_tokens + 1, query_len, dtype=torch.int32,
                                     device=dev),
        seq_lens=seq_lens.to(torch.int32),
        output=torch.empty(num_tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev),
        num_reqs=num_reqs, num_tokens=num_tokens, max_query_len=query_len,
    )


@dataclass(frozen=True)
class Variant:
    """splits 0: the varlen kernel; else the split-KV kernel with that many segments."""

    splits: int
    launch: KeyLoopLaunch

    def runner(self, b: dict):
        if self.splits == 0:
            return lambda: paged_attention(b["query"], b["kv_cache"], b["block_table"],
                                           b["query_start_loc"], b["seq_lens"], b["num_reqs"],
                                           b["num_tokens"], b["max_query_len"], HEAD_DIM**-0.5,
                                           b["output"], self.launch)
        return lambda: paged_attention_split_kv(b["query"], b["kv_cache"], b["block_table"],
                                                b["query_start_loc"], b["seq_lens"],
                                                b["num_reqs"], HEAD_DIM**-0.5, b["output"],
                                                self.splits, self.launch)

    def row(self) -> dict:
        return {"splits": self.splits, "launch": self.launch.__dict__}


def decode_variants() -> list[Variant]:
    """The varlen kernel's default, then the split-KV kernel at 1, 2 and 4 segments with each
    launch below."""
    out = [Variant(0, DEFAULT_LAUNCH)]  # at head_dim 128: 64-key tiles, 4 warps, 3 stages
    launches = [KeyLoopLaunch(t, w, s) for t, w, s in
                ((64, 4, 3), (64, 4, 2), (128, 4, 3), (128, 4, 2), (128, 4, 4), (128, 8, 3),
                 (64, 4, 5), (128, 4, 5), (256, 4, 2), (256, 8, 2), (256, 8, 3),
                 (64, 4, 1), (128, 4, 1), (128, 8, 1))]
    # 5 stages: the first depth with 2 K/V buffers; 256-key tiles: for an FP8 cache; 1 stage:
    # loads without asynchronous copies
    return [*out, *(Variant(n, launch) for n, launch in itertools.product((1, 2, 4), launches))]


def prefill_variants() -> list[Variant]:
    """Query tiles of 64 rows (the default: 16 queries x 4 heads) and 128, with key tiles,
    warps and pipeline depths."""
    out = [Variant(0, DEFAULT_LAUNCH)]
    out += [Variant(0, KeyLoopLaunch(t, w, s, m))
            for m, t, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2, 3))
            if (m, t, w, s) != (64, 64, 4, 3)]
    return out


def sweep(b: dict, variants: list[Variant], work: float, ceiling: float):
    """Each variant's us per launch, error against the default's output, and ``work`` (bytes
    or FLOPs) per second against ``ceiling``; the default first, then the rest by time."""
    Variant(0, DEFAULT_LAUNCH).runner(b)()
    reference = b["output"].clone()
    rows = []
    for variant in variants:
        try:
            fn = variant.runner(b)
            b["output"].fill_(float("nan"))  # a variant that skips rows shows as an error
            fn()
            err = (b["output"].float() - reference.float()).abs().max().item()
            us = graph_us(fn)
        except Exception as e:  # a shape that does not compile (shared memory)
            rows.append({**variant.row(), "error": str(e)[:160]})
            continue
        rows.append({**variant.row(), "us": us, "max_err": err,
                     "of_ceiling": work / (us * 1e-6) / ceiling})
    return rows[0], sorted((r for r in rows if "us" in r), key=lambda r: r["us"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenarios", default=",".join([*DECODE, "p8x1024", "p4x2048"]))
    parser.add_argument("--block-size", type=int, default=BLOCK, help="KV cache block size")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                        help="auto: bf16 (the model's dtype); fp8: float8_e4m3fn, scales 1.0")
    args = parser.parse_args()
    cache_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else torch.bfloat16
    cache_bytes = cache_dtype.itemsize
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    report, best = {}, {}
    for name in args.scenarios.split(","):
        if name in DECODE:  # bandwidth-bound: KV bytes read against the copy bandwidth
            num_reqs, context = DECODE[name]
            b = paged_batch(num_reqs, 1, context, args.block_size, cache_dtype)
            work, ceiling, variants = (int(b["seq_lens"].sum()) * KV_HEADS * HEAD_DIM * 2 * cache_bytes,
                                       COPY_BANDWIDTH, decode_variants())
        else:  # compute-bound: causal QK^T and PV FLOPs against the matmul peak
            num_reqs, context = PREFILL[name]
            b = paged_batch(num_reqs, context, context, args.block_size, cache_dtype)
            work, ceiling, variants = (num_reqs * 4.0 * HEADS * HEAD_DIM * context * (context + 1) / 2,
                                       MATMUL_PEAK, prefill_variants())
        default, ok = sweep(b, variants, work, ceiling)
        report[name] = {"num_reqs": num_reqs, "context": context, "work": work,
                        "ceiling": ceiling, "default": default, "variants": ok}
        best[name] = ok[0]
        print(f"{name}: default {default.get('us', 0):.1f} us "
              f"({default.get('of_ceiling', 0):.3f}); best {ok[0]['splits']} splits "
              f"{ok[0]['launch']} {ok[0]['us']:.1f} us ({ok[0]['of_ceiling']:.3f}), "
              f"err {ok[0]['max_err']:.2e}", flush=True)
        for r in ok[1:6]:
            print(f"    {r['splits']} {r['launch']} {r['us']:.1f} us",
                  flush=True)
        (args.out / "attention_sweep.json").write_text(json.dumps(report, indent=1))
    (args.out / "best.json").write_text(json.dumps(best, indent=1))


if __name__ == "__main__":
    main()
