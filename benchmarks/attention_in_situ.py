"""Why is the batch-256 decode attention slower inside the engine's step than alone?

    python benchmarks/attention_in_situ.py --out DIR      # on the GPU

Session 9 (BENCHMARKS.md) measured the split-KV kernel with the engine's launch at 373 us per
layer on ``attention_sweep.py``'s synthetic batch (256 requests at context 1500, shuffled
16-token blocks, one layer's cache launched 10 times) and at 402 us per layer inside the
engine's decode step (``gpu_profile.py --scenarios b256``), on one machine. This probe starts
the same engine (Llama-3-8B shape, dummy bf16 weights), brings 256 requests to context 1500,
then times the attention of the 32 layers alone (a CUDA graph of 32 launches, median of 15
replays) on the engine's own KV caches and block tables:

- ``engine_tables``: the running requests' block tables as the engine allocated them;
- ``shuffled_tables``: the same blocks, permuted at random among the requests' blocks (the
  sweep's placement);
- ``one_layer``: layer 0's cache in all 32 launches (the sweep's footprint);
- ``after_gemm``: each launch preceded by the layer's QKV GEMM at 256 rows (what runs before
  the attention in a step: L2 contents, clocks).

Against the engine's in-step figure, the first tells whether the kernel is slower on the
engine's data at all, the next two whether placement or footprint explains it, the last
whether the work before it does. Writes DIR/attention_in_situ.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from gpu_profile import CONFIGS, start_decoding
from graph_timing import COPY_BANDWIDTH, capture_graph, median_ms

from pagedserve import LLM
from pagedserve.attention.backends.triton import SPLIT_KV_LAUNCH
from pagedserve.kernels.paged_attention_split import paged_attention_split_kv

BATCH, CONTEXT, REPS = 256, 1500, 15


def running_tables(llm: LLM) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 [BATCH, max_blocks] block table and int32 [BATCH] seq_lens of the running
    requests (each with its next decode row), on the device."""
    scheduler = llm.engine_core.scheduler
    rows, lens = [], []
    for request in scheduler.running[:BATCH]:
        (ids,) = scheduler.kv_cache_manager.get_block_ids(request.request_id)
        rows.append(ids)
        lens.append(request.num_computed_tokens + 1)
    width = max(len(r) for r in rows)
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    return table.cuda(), torch.tensor(lens, dtype=torch.int32).cuda()


def shuffled(table: torch.Tensor) -> torch.Tensor:
    """The same block ids, permuted at random among the table's used (non-zero) entries."""
    out = table.clone()
    used = out != 0
    ids = out[used]
    out[used] = ids[torch.randperm(ids.numel(), device=ids.device)]
    return out


def attention_run(caches: list[torch.Tensor], table: torch.Tensor, seq_lens: torch.Tensor,
                  query: torch.Tensor, before: Callable[[int], object] | None = None):
    """The 32 launches of the engine's decode attention (``before(layer)`` ahead of each)."""
    qsl = torch.arange(BATCH + 1, dtype=torch.int32, device="cuda")
    out = torch.empty_like(query)  # [BATCH, heads, head_dim]

    def run() -> None:
        for layer, cache in enumerate(caches):
            if before is not None:
                before(layer)
            paged_attention_split_kv(query, cache, table, qsl, seq_lens, BATCH,
                                     query.shape[2] ** -0.5, out, 1, SPLIT_KV_LAUNCH)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp())
    shutil.copy(CONFIGS / "llama-3-8b.json", work / "config.json")
    llm = LLM(model=str(work), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              gpu_memory_utilization=0.85, max_num_seqs=BATCH)
    start_decoding(llm, BATCH, CONTEXT, 8)
    runner = llm.engine_core.model_runner
    caches = list(runner.kv_caches.values())  # each [2, num_blocks, block_size, kv_heads, dim]
    table, seq_lens = running_tables(llm)
    num_heads = runner.hf_config.num_attention_heads
    query = torch.randn(BATCH, num_heads, caches[0].shape[4], dtype=torch.bfloat16,
                        device="cuda")
    hidden = torch.randn(BATCH, runner.hf_config.hidden_size, dtype=torch.bfloat16,
                         device="cuda")
    qkv = torch.randn(query.shape[1] * query.shape[2] + 2 * caches[0].shape[3] * caches[0].shape[4],
                      hidden.shape[1], dtype=torch.bfloat16, device="cuda")
    variants = {
        "engine_tables": attention_run(caches, table, seq_lens, query),
        "shuffled_tables": attention_run(caches, shuffled(table), seq_lens, query),
        "one_layer": attention_run([caches[0]] * len(caches), table, seq_lens, query),
        "after_gemm": attention_run(caches, table, seq_lens, query,
                                    lambda layer: torch.nn.functional.linear(hidden, qkv)),
    }
    kv_bytes = int(seq_lens.sum()) * caches[0].shape[3] * caches[0].shape[4] * 2 * 2 * len(caches)
    report = {"kv_bytes": kv_bytes, "num_layers": len(caches), "variants": {}}
    for name, run in variants.items():
        ms = median_ms(capture_graph(run).replay, REPS)
        report["variants"][name] = {"ms": ms, "us_per_layer": ms * 1e3 / len(caches),
                                    "of_copy_bw": kv_bytes / (ms * 1e-3) / COPY_BANDWIDTH}
        print(f"{name}: {ms:.2f} ms ({ms * 1e3 / len(caches):.1f} us per layer, "
              f"{kv_bytes / (ms * 1e-3) / COPY_BANDWIDTH:.2f} of copy bw)", flush=True)
    gemm = capture_graph(lambda: [torch.nn.functional.linear(hidden, qkv) for _ in caches])
    report["qkv_gemms_alone_ms"] = median_ms(gemm.replay, REPS)
    print(f"the 32 QKV GEMMs alone: {report['qkv_gemms_alone_ms']:.2f} ms (after_gemm includes "
          "them)", flush=True)
    (args.out / "attention_in_situ.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
