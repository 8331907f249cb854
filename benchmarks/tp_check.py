"""Tensor parallelism on two GPUs of one host: TP=2 against TP=1 on the Llama-3-8B shape.

``python benchmarks/tp_check.py all --out DIR`` runs, with dummy bf16 weights (the same
values under any TP size, see ``model/dummy_weights.py``):

1. greedy tokens of a fixed prompt set (with top-5 logprobs), TP=1 and TP=2: equal?
   At the first divergence of a prompt, if any, each side's token should be in the other's
   top-5 (the project's oracle rule: bf16 sums in another order may flip a near-tie);
2. the batch-1 decode step time (``pagedserve bench latency``: 1024 in / 128 out);
3. the throughput of 1000 prompts of 1000 in / 1000 out (``pagedserve bench throughput``);

then prints the scaling ratios (decode step TP=1 / TP=2, throughput TP=2 / TP=1) and writes
them to DIR/tp_scaling.json. Each TP size runs in a fresh process (``run --tp N``: one engine,
all sections, DIR/tp{N}.json), so the machine's whole memory is the engine's. The runs can be
made one by one (each fits a 10-minute command limit) and compared with ``compare --out DIR``.

It uses the bench's own functions (``latency.run`` / ``throughput.run``). Nothing here imports
the server stack.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

CONFIG = Path(__file__).resolve().parent / "model-configs" / "llama-3-8b.json"
ENGINE = ["--load-format", "dummy", "--dtype", "bfloat16", "--temperature", "0",
          "--gpu-memory-utilization", "0.9", "--max-num-seqs", "256"]  # fmt: skip
NUM_GREEDY_PROMPTS = 16
GREEDY_TOKENS = 64
TOP_K = 5


def bench_args(argv: list[str]) -> argparse.Namespace:
    from pagedserve.entrypoints.cli import build_parser

    parser, _ = build_parser("bench")
    return parser.parse_args(["bench", *argv])


def greedy(llm: Any) -> dict[str, Any]:
    """Tokens and top-5 logprobs of a fixed, seeded prompt set (lengths 3 to ~1900)."""
    import numpy as np

    from pagedserve import SamplingParams

    rng = np.random.default_rng(1234)
    lengths = [3, 17, 64, 128, 250, 511, 700, 1900] * (NUM_GREEDY_PROMPTS // 8)
    prompts = [{"prompt_token_ids": rng.integers(100, 32000, size=n).tolist()} for n in lengths]
    params = SamplingParams(
        temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True, logprobs=TOP_K
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return {
        "tokens": [o.outputs[0].token_ids for o in outputs],
        "top": [[sorted(step, key=lambda t: step[t].logprob, reverse=True)[:TOP_K]
                 for step in o.outputs[0].logprobs] for o in outputs],
    }  # fmt: skip


def run_one(tp: int, out: Path, args: argparse.Namespace) -> None:
    """One engine of TP=``tp``; every section's result (or error) into out/tp{tp}.json."""
    from pagedserve.entrypoints.bench import latency, throughput
    from pagedserve.entrypoints.bench.common import make_llm

    work = Path(tempfile.mkdtemp())
    shutil.copy(args.config, work / "config.json")
    engine = ["--model", str(work), *ENGINE, *args.engine_args.split(),
              "--tensor-parallel-size", str(tp)]  # fmt: skip
    workloads = {
        "greedy": lambda llm: greedy(llm),
        "latency": lambda llm: latency.run(
            llm, bench_args(["latency", *engine, *args.latency_args.split()])),
        "throughput": lambda llm: throughput.run(
            llm, bench_args(["throughput", *engine, *args.throughput_args.split()])),
    }  # fmt: skip
    result: dict[str, Any] = {"tensor_parallel_size": tp}
    start = time.perf_counter()
    llm = make_llm(bench_args(["latency", *engine]))
    result["start_s"] = round(time.perf_counter() - start, 1)
    for name in args.sections.split(","):
        start = time.perf_counter()
        try:
            result[name] = workloads[name](llm)
        except Exception as e:  # one failing section must not lose the others
            traceback.print_exc()
            result[name] = {"error": f"{type(e).__name__}: {e}"[:600]}
        print(f"[tp{tp}] {name}: {time.perf_counter() - start:.1f} s", flush=True)
        (out / f"tp{tp}.json").write_text(json.dumps(result, default=str))
    llm.engine_core.shutdown()


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def compare_greedy(one: dict[str, Any], two: dict[str, Any]) -> dict[str, Any]:
    equal, close, divergences = 0, 0, []
    for i, (a, b) in enumerate(zip(one["tokens"], two["tokens"], strict=True)):
        pos = first_divergence(a, b)
        if pos is None:
            equal += 1
            continue
        in_top = a[pos] in two["top"][i][pos] and b[pos] in one["top"][i][pos]
        close += in_top
        divergences.append({"prompt": i, "position": pos, "tp1": a[pos], "tp2": b[pos],
                            "each_in_others_top5": in_top})  # fmt: skip
    n = len(one["tokens"])
    return {"prompts": n, "equal": equal, "all_equal": equal == n,
            "diverged_within_top5": close, "divergences": divergences}  # fmt: skip


def compare(out: Path) -> dict[str, Any]:
    one = json.loads((out / "tp1.json").read_text())
    two = json.loads((out / "tp2.json").read_text())
    report: dict[str, Any] = {}
    if "tokens" in one.get("greedy", {}) and "tokens" in two.get("greedy", {}):
        report["greedy"] = compare_greedy(one["greedy"], two["greedy"])
    if "decode_step_ms" in one.get("latency", {}) and "decode_step_ms" in two.get("latency", {}):
        step1, step2 = one["latency"]["decode_step_ms"], two["latency"]["decode_step_ms"]
        report["decode_step_ms"] = {"tp1": step1, "tp2": step2, "speedup": step1 / step2}
    if "output_tok_per_s" in one.get("throughput", {}) and "output_tok_per_s" in two.get(
        "throughput", {}
    ):
        t = one["throughput"]
        tps1, tps2 = t["output_tok_per_s"], two["throughput"]["output_tok_per_s"]
        workload = f"{t['num_prompts']} x ({t['input_len']} in / {t['output_len']} out)"
        report["output_tok_per_s"] = {"workload": workload, "tp1": tps1, "tp2": tps2,
                                      "scaling": tps2 / tps1}  # fmt: skip
    report["errors"] = {f"tp{r['tensor_parallel_size']}.{k}": v["error"]
                        for r in (one, two) for k, v in r.items()
                        if isinstance(v, dict) and "error" in v}  # fmt: skip
    (out / "tp_scaling.json").write_text(json.dumps(report, indent=2))
    _print_report(report)
    return report


def _print_report(report: dict[str, Any]) -> None:
    if "greedy" in report:
        g = report["greedy"]
        print(f"greedy: {g['equal']}/{g['prompts']} prompts equal over {GREEDY_TOKENS} tokens; "
              f"{g['diverged_within_top5']} divergences within each other's top-5")  # fmt: skip
    if "decode_step_ms" in report:
        d = report["decode_step_ms"]
        print(f"batch-1 decode step: TP=1 {d['tp1']:.3f} ms, TP=2 {d['tp2']:.3f} ms: "
              f"{d['speedup']:.2f}x faster")  # fmt: skip
    if "output_tok_per_s" in report:
        t = report["output_tok_per_s"]
        print(f"throughput {t['workload']}: TP=1 {t['tp1']:.0f}, TP=2 "
              f"{t['tp2']:.0f} output tok/s: scaling {t['scaling']:.2f}x")  # fmt: skip
    for name, error in report["errors"].items():
        print(f"ERROR {name}: {error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["all", "run", "compare"])
    parser.add_argument("--out", default=".")
    parser.add_argument("--tp", type=int, default=1, help="run: the tensor-parallel size")
    parser.add_argument("--sections", default="greedy,latency,throughput")
    parser.add_argument("--config", default=str(CONFIG), help="the model shape (config.json)")
    parser.add_argument(
        "--engine-args",
        default="",
        help='more engine options, winning over ours: --engine-args="--device cpu"',
    )
    parser.add_argument("--latency-args", default="--batch-size 1 --num-iters 3")
    parser.add_argument(
        "--throughput-args", default="--num-prompts 1000 --input-len 1000 --output-len 1000"
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.mode == "run":
        run_one(args.tp, out, args)
    elif args.mode == "all":
        for tp in (1, 2):  # a fresh process each: no GPU memory carried over
            subprocess.run([sys.executable, __file__, "run", *sys.argv[2:], "--tp", str(tp)],
                           check=True)  # fmt: skip
        compare(out)
    else:
        compare(out)


if __name__ == "__main__":
    main()
