"""Launch shapes of the decode attention kernels, timed on their own (Llama-3-8B attention).

    python benchmarks/attention_sweep.py --out DIR

Decode batches of the issue-11 workloads (64 requests at context 1024: target 2; 256 at 1500:
the middle of target 3's decode), bf16 paged KV cache (block size 16, shuffled block tables),
32 query / 8 KV heads of 128. For the varlen kernel (what a decode batch runs when splitting
would not add programs) and the split-KV kernels at forced split counts, every key-tile size,
warp count and pipeline depth listed below: median of 15 replays of a CUDA graph of 10
launches, as us per launch and as KV bytes read per second against the card's copy bandwidth.
Writes ``attention_sweep.json`` and ``best.json`` (the fastest shape per batch).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
from graph_timing import COPY_BANDWIDTH, graph_time_ms

from pagedserve.kernels.paged_attention import DEFAULT_LAUNCH, KeyLoopLaunch, paged_attention
from pagedserve.kernels.paged_attention_split import paged_attention_split_kv

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
SCENARIOS = {"b64": (64, 1024), "b256": (256, 1500)}


def graph_us(fn, launches: int = 10, reps: int = 15) -> float:
    """us per launch: a graph of ``launches`` calls of ``fn``, median of ``reps`` replays."""
    return graph_time_ms(lambda: [fn() for _ in range(launches)], reps) * 1e3 / launches


def batch(num_reqs: int, context: int) -> dict:
    dev = "cuda"
    blocks_per_req = context // BLOCK
    num_blocks = num_reqs * blocks_per_req + 1
    table = (torch.randperm(num_blocks - 1, device=dev) + 1).view(num_reqs, blocks_per_req)
    return dict(
        query=torch.randn(num_reqs, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev),
        kv_cache=torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16,
                             device=dev),
        block_table=table.to(torch.int32),
        query_start_loc=torch.arange(num_reqs + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.full((num_reqs,), context, dtype=torch.int32, device=dev),
        output=torch.empty(num_reqs, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev),
    )


def runner(b: dict, splits: int, launch: KeyLoopLaunch):
    n = b["query"].shape[0]
    if splits == 1:
        return lambda: paged_attention(b["query"], b["kv_cache"], b["block_table"],
                                       b["query_start_loc"], b["seq_lens"], n, n, 1,
                                       HEAD_DIM**-0.5, b["output"], launch)
    return lambda: paged_attention_split_kv(b["query"], b["kv_cache"], b["block_table"],
                                            b["query_start_loc"], b["seq_lens"], n,
                                            HEAD_DIM**-0.5, b["output"], splits, launch)


def variants() -> list[tuple[int, KeyLoopLaunch]]:
    out = [(1, DEFAULT_LAUNCH)]  # at head_dim 128: 64-key tiles, 4 warps, 3 stages
    out += [(1, KeyLoopLaunch(t, w, s))
            for t, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))
            if (t, w, s) != (64, 4, 3)]
    out += [(n, KeyLoopLaunch(t, w, 3)) for n, t, w in itertools.product((2, 4), (64, 128), (4, 8))]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    report, best = {}, {}
    for name, (num_reqs, context) in SCENARIOS.items():
        b = batch(num_reqs, context)
        nbytes = num_reqs * context * KV_HEADS * HEAD_DIM * 2 * 2
        paged_attention(b["query"], b["kv_cache"], b["block_table"], b["query_start_loc"],
                        b["seq_lens"], num_reqs, num_reqs, 1, HEAD_DIM**-0.5, b["output"])
        reference = b["output"].clone()
        rows = []
        for splits, launch in variants():
            try:
                fn = runner(b, splits, launch)
                b["output"].fill_(float("nan"))  # a variant that skips rows shows as an error
                fn()
                err = (b["output"].float() - reference.float()).abs().max().item()
                us = graph_us(fn)
            except Exception as e:  # a shape that does not compile (shared memory)
                rows.append({"splits": splits, "launch": launch.__dict__, "error": str(e)[:160]})
                continue
            rows.append({"splits": splits, "launch": launch.__dict__, "us": us, "max_err": err,
                         "of_copy_bw": nbytes / (us * 1e-6) / COPY_BANDWIDTH})
        ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        report[name] = {"num_reqs": num_reqs, "context": context, "kv_bytes": nbytes,
                        "default_us": rows[0].get("us"), "variants": ok}
        best[name] = ok[0]
        print(f"{name}: default {rows[0].get('us', 0):.1f} us "
              f"({rows[0].get('of_copy_bw', 0):.3f}); best {ok[0]['splits']} splits "
              f"{ok[0]['launch']} {ok[0]['us']:.1f} us ({ok[0]['of_copy_bw']:.3f}), "
              f"err {ok[0]['max_err']:.2e}", flush=True)
        for r in ok[1:6]:
            print(f"    {r['splits']} {r['launch']} {r['us']:.1f} us", flush=True)
        (args.out / "attention_sweep.json").write_text(json.dumps(report, indent=1))
    (args.out / "best.json").write_text(json.dumps(best, indent=1))


if __name__ == "__main__":
    main()
