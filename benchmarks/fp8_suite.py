"""FP8 against bf16 on one GPU: the FP8 issue's targets side by side, from one command.

``python benchmarks/suite.py --out DIR --sections fp8`` (or ``python benchmarks/fp8_suite.py
--out DIR [--engines 8b.bf16,8b.fp8] [--max-num-seqs N]``) runs three engines (or those named),
each in a fresh process so that one engine's memory cannot shrink the next one's KV budget, all
with dummy weights, greedy, 0.9 of the card, at most ``MAX_NUM_SEQS`` (1024) sequences:

- ``8b.bf16``: the Llama-3-8B shape, bf16 weights, bf16 KV cache;
- ``8b.fp8``: the same with FP8 weights (``--quantization fp8``) and an FP8 KV cache
  (``--kv-cache-dtype fp8``, scales 1.0);
- ``70b.fp8``: the Llama-3-70B shape, FP8 weights and KV cache, ``--max-model-len 4096``.

On each 8B engine: ``b1`` (the batch-1 decode step, 1024-token prompt), ``t1000`` (1000 prompts
of 1000 in / 1000 out) and ``t2048`` (2048 in / 128 out, fewer prompts: see ``WORKLOADS``);
on the 70B one ``b1`` and ``t1000`` with fewer prompts. Throughput runs report output tok/s and,
on NVIDIA cards, output tokens per joule. The table at the end puts bf16 and FP8 side by side
with the issue's targets. Each result is also one JSON line in DIR/suite.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from suite import COMMON, Suite, bench_args, model_dir

ENGINES = {
    "8b.bf16": ("llama-3-8b.json", []),
    "8b.fp8": ("llama-3-8b.json", ["--quantization", "fp8", "--kv-cache-dtype", "fp8"]),
    "70b.fp8": ("llama-3-70b.json", ["--quantization", "fp8", "--kv-cache-dtype", "fp8",
                                     "--max-model-len", "4096"]),
}
ENGINE_ARGS = ["--gpu-memory-utilization", "0.9"]
MAX_NUM_SEQS = 1024
"""vLLM's default on a card of this size: the cap under which an FP8 cache's doubled blocks
turn into a larger decode batch."""
WORKLOADS = {  # (bench command, its arguments); prompt counts aim the three engines at ~6 min
    "b1": ("latency", ["--batch-size", "1", "--num-iters", "2"]),
    "t1000": ("throughput", ["--num-prompts", "1000", "--input-len", "1000",
                             "--output-len", "1000"]),
    "t2048": ("throughput", ["--num-prompts", "400", "--input-len", "2048",
                             "--output-len", "128"]),
    "t1000_70b": ("throughput", ["--input-len", "1000", "--output-len", "1000"]),
}
PROMPTS_70B = 64
"""The 70B's 1000 x 1000/1000 runs fewer prompts by default, to keep the suite short."""
RUNS = {"8b.bf16": ["b1", "t1000", "t2048"], "8b.fp8": ["b1", "t1000", "t2048"],
        "70b.fp8": ["b1", "t1000_70b"]}
FIGURES = ("decode_step_ms", "output_tok_per_s", "output_tok_per_j", "num_kv_blocks",
           "max_batch_kv_allows", "num_prompts")
TIMEOUT_S = 900  # one engine's process


def run_engine(name: str, out: Path, max_num_seqs: int, prompts_70b: int) -> None:
    """Start ``name``'s engine here and run its workloads (the child process)."""
    from pagedserve.entrypoints.bench import latency, throughput
    from pagedserve.entrypoints.bench.common import make_llm

    suite, work = Suite(out), Path(tempfile.mkdtemp())
    config, extra = ENGINES[name]
    engine = ["--model", model_dir(work, config), *COMMON, *ENGINE_ARGS,
              "--max-num-seqs", str(max_num_seqs), *extra]
    llm = suite.run(f"fp8.{name}.start", make_llm, bench_args(["latency", *engine]))
    if llm is None:
        return
    modules = {"latency": latency, "throughput": throughput}
    for key in RUNS[name]:
        command, argv = WORKLOADS[key]
        if key == "t1000_70b":
            argv = [*argv, "--num-prompts", str(prompts_70b)]
        result = suite.run(f"fp8.{name}.{key}", modules[command].run, llm,
                           bench_args([command, *engine, *argv]))
        if isinstance(result, dict):
            figures = {k: result[k] for k in FIGURES if result.get(k) is not None}
            with open(out / "fp8.json", "a") as f:
                f.write(json.dumps({"engine": name, "workload": key, **figures}) + "\n")


def run_all(suite: Suite, out: Path, engines: list[str], max_num_seqs: int,
            prompts_70b: int) -> None:
    """Each engine in its own process, then the side-by-side table."""
    (out / "fp8.json").unlink(missing_ok=True)
    for name in engines:
        done = subprocess.run([sys.executable, __file__, "--engine", name, "--out", str(out),
                               "--max-num-seqs", str(max_num_seqs),
                               "--prompts-70b", str(prompts_70b)],
                              timeout=TIMEOUT_S, check=False)
        if done.returncode != 0:
            suite.log(f"fp8.{name}", error=f"exit status {done.returncode}")
    rows = [json.loads(line) for line in (out / "fp8.json").read_text().splitlines()] \
        if (out / "fp8.json").exists() else []
    table = side_by_side({(r["engine"], r["workload"]): r for r in rows})
    print("\n".join(table), flush=True)
    suite.log("fp8.table", lines=table)


def _figure(rows: dict, engine: str, workload: str, key: str) -> float | None:
    value = rows.get((engine, workload), {}).get(key)
    return None if value is None else float(value)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def side_by_side(rows: dict) -> list[str]:
    """Lines of the table: each figure for bf16 and FP8, their ratio, the issue's target."""
    lines = [f"{'Llama-3-8B shape':<38}{'bf16':>12}{'FP8':>12}{'FP8/bf16':>10}  target"]
    checks = [
        ("1. batch-1 step, ms", "b1", "decode_step_ms", "FP8 <= 2.4 ms"),
        ("2. 1000x1000/1000 output tok/s", "t1000", "output_tok_per_s", ">= 1.6x"),
        ("4. 1000x1000/1000 output tok/J", "t1000", "output_tok_per_j", "~ tok/s ratio"),
        ("   1000x1000/1000 KV blocks", "t1000", "num_kv_blocks", ">= 2x (1 byte/element)"),
        ("3. 2048/128 output tok/s", "t2048", "output_tok_per_s", ">= 1.5x"),
        ("4. 2048/128 output tok/J", "t2048", "output_tok_per_j", "~ tok/s ratio"),
    ]
    for label, workload, key, target in checks:
        bf16 = _figure(rows, "8b.bf16", workload, key)
        fp8 = _figure(rows, "8b.fp8", workload, key)
        ratio = None if not bf16 or fp8 is None else fp8 / bf16
        lines.append(f"{label:<38}{_fmt(bf16):>12}{_fmt(fp8):>12}{_fmt(ratio):>10}  {target}")
    prompts = {w: _figure(rows, "8b.fp8", w, "num_prompts") for w in ("t1000", "t2048")}
    lines.append(f"(8B prompts: t1000 {_fmt(prompts['t1000'])}, t2048 {_fmt(prompts['t2048'])})")
    lines.append("5. Llama-3-70B shape, FP8 weights + FP8 KV cache, --max-model-len 4096:")
    step = _figure(rows, "70b.fp8", "b1", "decode_step_ms")
    tps = _figure(rows, "70b.fp8", "t1000_70b", "output_tok_per_s")
    tpj = _figure(rows, "70b.fp8", "t1000_70b", "output_tok_per_j")
    n = _figure(rows, "70b.fp8", "t1000_70b", "num_prompts")
    lines.append(f"   batch-1 step {_fmt(step)} ms; 1000/1000 with {_fmt(n)} prompts: "
                 f"{_fmt(tps)} output tok/s, {_fmt(tpj)} tok/J")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--engine", choices=sorted(ENGINES),
                        help="run this engine's workloads here (what the parent process asks)")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help="the engines to run, in order (70b.fp8 needs a card of ~100 GB)")
    parser.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS)
    parser.add_argument("--prompts-70b", type=int, default=PROMPTS_70B,
                        help="prompts of the 70B's 1000 x 1000/1000 (1000 for the full workload)")
    args = parser.parse_args()
    if args.prompts_70b < 1:
        parser.error(f"--prompts-70b: must be >= 1, got {args.prompts_70b}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.engine is not None:
        run_engine(args.engine, out, args.max_num_seqs, args.prompts_70b)
        return
    engines = args.engines.split(",")
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        parser.error(f"--engines: unknown {unknown}; choose from {sorted(ENGINES)}")
    run_all(Suite(out), out, engines, args.max_num_seqs, args.prompts_70b)


if __name__ == "__main__":
    main()
