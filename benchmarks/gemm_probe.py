"""Are cuBLAS's default GEMM choices the fastest for our linear layers? Timed alone, then tuned.

    python benchmarks/gemm_probe.py --out DIR [--rows 64 256 8192]

The Llama-3-8B linear layers (qkv, o, gate_up, down, LM head: ``gemv_sweep.py``'s shapes) as
``F.linear`` on bf16 random weights, at the token counts of a batch-64 decode step, a batch-256
decode step (target 3's decode) and an 8,192-token prefill step: first with cuBLAS's heuristic
choice, then with torch's TunableOp (``torch.cuda.tunable``: every candidate algorithm timed
once per shape, the fastest kept). Each: median of 15 replays of a CUDA graph of 10 calls, as us
per call and as FLOP/s against the bf16 matmul peak; ``step_ms`` adds one step's worth (32
layers + LM head).
Writes ``gemm_probe.json`` and TunableOp's ``tunableop_results.csv``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from gemv_sweep import LAYERS, LM_HEAD
from gemv_sweep import SHAPES as LAYER_SHAPES
from graph_timing import MATMUL_PEAK, graph_time_ms

# name -> (out features, in features, calls per step)
SHAPES = {**{name: (*shape, LAYERS) for name, shape in LAYER_SHAPES.items()},
          "lm_head": (*LM_HEAD, 1)}


def time_shapes(rows: int) -> dict:
    out, step_us = {}, 0.0
    for name, (n, k, calls) in SHAPES.items():
        if name == "lm_head" and rows > 512:
            continue  # a prefill step computes logits for a few rows only
        x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        us = graph_time_ms(lambda x=x, w=w: [F.linear(x, w) for _ in range(10)], 15) * 100
        out[name] = {"us": us, "of_peak": 2 * rows * n * k / (us * 1e-6) / MATMUL_PEAK}
        step_us += us * calls
    out["step_ms"] = step_us / 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256, 8192])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    report = {"default": {}, "tuned": {}}
    for rows in args.rows:
        report["default"][rows] = time_shapes(rows)
    torch.cuda.tunable.enable(True)
    torch.cuda.tunable.tuning_enable(True)
    torch.cuda.tunable.set_filename(str(args.out / "tunableop_results.csv"))
    for rows in args.rows:
        report["tuned"][rows] = time_shapes(rows)
    (args.out / "gemm_probe.json").write_text(json.dumps(report, indent=1))
    write_file = getattr(torch.cuda.tunable, "write_file", None)  # torch 2.11 writes on exit
    if write_file is not None:
        write_file()
    for rows in args.rows:
        d, t = report["default"][rows], report["tuned"][rows]
        print(f"rows {rows}: step {d['step_ms']:.3f} -> {t['step_ms']:.3f} ms; " + ", ".join(
            f"{n} {d[n]['of_peak']:.2f}->{t[n]['of_peak']:.2f}" for n in SHAPES if n in d),
            flush=True)


if __name__ == "__main__":
    main()
