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

``--chain SECONDS``: instead, the 32 layers' four GEMMs in order, each layer with its own
weights (as a step runs them; LM head left out), as one CUDA graph replayed back to back for
SECONDS: each replay's ms, to tell a rate the card holds only for short bursts (power or
clock limits) from the isolated figures. Writes ``gemm_chain.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from gemv_sweep import LAYERS, LM_HEAD
from gemv_sweep import SHAPES as LAYER_SHAPES
from graph_timing import MATMUL_PEAK, capture_graph, graph_time_ms, timed_ms

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


def chain_rows(rows: int, seconds: float) -> dict:
    """The 32-layer GEMM chain at ``rows`` rows, replayed back to back for ``seconds``."""
    layers = [{name: torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
               for name, (n, k, _) in SHAPES.items() if name != "lm_head"}
              for _ in range(LAYERS)]
    inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
              for k in {k for _, k, _ in SHAPES.values()}}  # [rows, in features]
    flops = sum(2 * rows * w.shape[0] * w.shape[1] for layer in layers for w in layer.values())
    graph = capture_graph(lambda: [F.linear(inputs[w.shape[1]], w)
                                   for layer in layers for w in layer.values()])
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        times.append(timed_ms(graph.replay))
    ordered = sorted(times)
    median = ordered[len(times) // 2]
    row = {"replays": len(times), "first_ms": times[:3], "last_ms": times[-3:],
           "min_ms": ordered[0], "median_ms": median, "max_ms": ordered[-1],
           "median_of_peak": flops / (median * 1e-3) / MATMUL_PEAK}
    print(f"rows {rows}: chain of {LAYERS} layers, {len(times)} replays: first "
          f"{times[0]:.2f}, min {ordered[0]:.2f}, median {median:.2f} ms "
          f"({row['median_of_peak']:.2f} of peak), last {times[-1]:.2f}", flush=True)
    del graph
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256, 8192])
    parser.add_argument("--chain", type=float, metavar="SECONDS",
                        help="time the 32-layer GEMM chain back to back instead (see above)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if args.chain:
        chain = {rows: {**chain_rows(rows, args.chain),
                        "isolated_sum_ms": time_shapes(rows)["step_ms"]} for rows in args.rows}
        for rows, row in chain.items():
            print(f"rows {rows}: isolated GEMMs summed {row['isolated_sum_ms']:.2f} ms"
                  + (" (with the LM head)" if rows <= 512 else ""), flush=True)
        (args.out / "gemm_chain.json").write_text(json.dumps(chain, indent=1))
        return
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
