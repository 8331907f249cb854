"""Attention of a mixed step: decode rows beside prompt chunks, through the Triton backend.

    python benchmarks/mixed_attention.py --out DIR [--scenarios t2048,t1000] [--kv-cache-dtype fp8]

A step of chunked prefill carries the running requests' decode rows (the batch orders them
first) and new prompts' chunks. ``together``: every row in one launch of the varlen kernel;
``apart``: the decode rows on the split-KV kernel, then the rest on the varlen kernel
(``TritonBackend.forward_apart`` with 0 or all the decode rows apart; ``forward`` runs them
apart where ``decodes_apart`` says so). ``decodes alone`` times the decode rows as a batch of their
own. Llama-3-8B attention (32 query / 8 KV heads of
128), one layer, shuffled block tables, us per launch: median of 10 replays of a CUDA graph of 5
launches. ``max_abs_diff``: apart against together, which must agree.

Scenarios are steady-state steps of the two throughput workloads at 1024 sequences (decodes,
their context range, the prompt chunks as (tokens, cached before)): t2048 from 1000 x 2048/128
(``benchmarks/sched_sim.py``: ~300 decode rows and ~5k prompt tokens a step), t1000 from
1000 x 1000/1000's steps that admit prompts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pagedserve.attention.backends.base import AttentionMetadata
from pagedserve.attention.backends.triton import TritonBackend
from pagedserve.entrypoints.bench.graph_timing import graph_time_ms

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
# decode rows, their seq_len range, prompt chunks as (query tokens, tokens cached before)
SCENARIOS: dict[str, tuple[int, tuple[int, int], list[tuple[int, int]]]] = {
    "t2048": (300, (2049, 2176), [(2048, 0), (2048, 0), (1000, 1048)]),
    "t2048_few": (190, (2049, 2176), [(2048, 0)] * 3 + [(1700, 348)]),
    "t1000": (450, (1000, 2000), [(1000, 0)] * 7 + [(700, 300)]),
    "t1000_many": (900, (1000, 2000), [(1000, 0)] * 7),
    "b64_p512": (64, (1000, 1100), [(512, 0)]),
}
LAUNCHES, REPS = 5, 10


def mixed_batch(num_decodes: int, decode_seq_lens: tuple[int, int],
                chunks: list[tuple[int, int]], cache_dtype: torch.dtype, dev: str = "cuda"):
    """(query [T, H, D], kv_cache, metadata, decode KV tokens) of ``num_decodes`` one-row
    requests (seq_lens uniform in ``decode_seq_lens``) then the prompt ``chunks``."""
    gen = torch.Generator().manual_seed(1)
    seq_lens = torch.randint(decode_seq_lens[0], decode_seq_lens[1] + 1, (num_decodes,),
                             generator=gen).tolist()
    query_lens = [1] * num_decodes + [q for q, _ in chunks]
    seq_lens += [q + c for q, c in chunks]
    blocks = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(blocks) + 1
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)  # [num_reqs, max_blocks]
    for i, n in enumerate(blocks):
        table[i, :n] = torch.tensor([ids.pop() for _ in range(n)])
    num_tokens = sum(query_lens)
    kv_cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16,
                           device=dev).to(cache_dtype)
    metadata = AttentionMetadata(
        num_reqs=len(seq_lens), num_actual_tokens=num_tokens, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor([0, *query_lens]).cumsum(0).int().to(dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_table=table.to(dev),
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=dev),
        num_decodes=num_decodes,
    )
    query = torch.randn(num_tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    return query, kv_cache, metadata, sum(seq_lens[:num_decodes])


def launch_us(run) -> float:
    def step() -> None:
        for _ in range(LAUNCHES):
            run()

    return graph_time_ms(step, REPS) * 1e3 / LAUNCHES


def scenario(backend: TritonBackend, name: str, cache_dtype: torch.dtype) -> dict:
    num_decodes, decode_seq_lens, chunks = SCENARIOS[name]
    query, kv_cache, metadata, decode_tokens = mixed_batch(num_decodes, decode_seq_lens,
                                                           chunks, cache_dtype)
    outputs, row = {}, {}
    for label, n in (("together", 0), ("apart", num_decodes)):
        out = outputs[label] = torch.empty_like(query)
        row[f"{label}_us"] = launch_us(lambda n=n, out=out: backend.forward_apart(
            query, kv_cache, metadata, n, HEAD_DIM**-0.5, out))
    diff = (outputs["apart"].float() - outputs["together"].float()).abs().max().item()
    query, kv_cache, metadata, _ = mixed_batch(num_decodes, decode_seq_lens, [], cache_dtype)
    alone = torch.empty_like(query)
    row["decodes_alone_us"] = launch_us(
        lambda: backend.forward(query, kv_cache, metadata, HEAD_DIM**-0.5, alone))
    row["max_abs_diff"] = diff
    row["decode_kv_bytes"] = decode_tokens * KV_HEADS * HEAD_DIM * 2 * cache_dtype.itemsize
    row["prompt_tokens"] = sum(q for q, _ in chunks)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--kv-cache-dtype", default="auto,fp8",
                        help="comma list of auto (bf16) and fp8 (float8_e4m3fn, scales 1.0)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    backend = TritonBackend()
    report = {}
    for kv in args.kv_cache_dtype.split(","):
        cache_dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
        for name in args.scenarios.split(","):
            row = scenario(backend, name, cache_dtype)
            report[f"{name}/{kv}"] = row
            print(f"{name}/{kv}: together {row['together_us']:.1f} us, apart "
                  f"{row['apart_us']:.1f} us, decodes alone {row['decodes_alone_us']:.1f} us, "
                  f"max diff {row['max_abs_diff']:.2e}", flush=True)
            (args.out / "mixed_attention.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
