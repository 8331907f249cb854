"""pagedserve and vLLM on the same workloads on one machine, each figure beside the other's.

``python benchmarks/vs_vllm.py run --out DIR --peer PEER [--engines pagedserve,vllm]
[--workloads b1,b64,t1000,t2048,cold] [--max-num-seqs 256,1024] [--num-prompts N]
[--quantization fp8] [--kv-cache-dtype fp8] [--plan]``

- vLLM: ``peers/vllm/bench_vllm.py`` runs each workload in its own subprocess, with
  ``PYTHONPATH`` = ``--vllm-pythonpath``: vLLM from the payload ``peers/vllm/prepare.sh``
  builds (PEER, default ``.peer-vllm``; its README says how it reaches the GPU machine).
- pagedserve: the bench functions ``suite.py`` uses (``pagedserve bench latency`` /
  ``throughput``), in one subprocess per ``--max-num-seqs`` value (one engine start runs that
  value's workloads).
- Same settings on both sides: the Llama-3-8B shape from ``PEER/llama3-8b`` with dummy bf16
  weights (FP8 weights quantized at load with ``--quantization fp8``, an FP8 KV cache with
  ``--kv-cache-dtype fp8``: both engines take the two options by these names),
  ``max_model_len`` 4096, ``gpu_memory_utilization`` 0.9, seed 0, random token-id prompts;
  ``b1`` / ``b64``: decode step at batch 1 / 64, 1024-token prompts, greedy, step = (t(128
  out) - t(1 out)) / 127; ``t1000``: N x 1000 in / 1000 out and ``t2048``: N x 2048 in / 128
  out, temperature 1.0, each at every ``--max-num-seqs`` value (the step workloads at the
  first one); ``cold``: each engine's first start-up, with empty compile caches (fresh
  ``XDG_CACHE_HOME``, ``TRITON_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR``, ``VLLM_CACHE_ROOT``
  for the whole run; without ``cold`` the machine's caches are used).

Throughput rows also give output tokens per joule: the card runs these workloads at its power
limit. pagedserve's bench reads NVML's energy counter around its timed run; for vLLM this
script samples the counter while the child runs and takes the window of its timed
``generate``.

Each figure is one JSON line in ``DIR/vs_vllm.jsonl``; the table of every line there (and in
other folders: ``python benchmarks/vs_vllm.py table DIR [DIR ...]``) prints each figure with
the ratio pagedserve / vLLM. ``--plan`` prints the runs and their estimated seconds (from the
2026-12-01 H200 figures) without running anything: one device call runs at most 10 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = "vs_vllm.jsonl"
CHILD_TAG = "VS_VLLM "
VLLM_BENCH = Path(__file__).resolve().parent / "peers" / "vllm" / "bench_vllm.py"
ENGINES = ("pagedserve", "vllm")
MAX_MODEL_LEN = 4096
GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class Workload:
    peer_name: str
    """``bench_vllm.py --workload``."""
    kind: str
    """latency or throughput (the pagedserve bench function)."""
    size: int
    """Batch (latency) or number of prompts (throughput, unless ``--num-prompts``)."""
    input_len: int
    output_len: int
    temperature: float
    estimate_s: float
    """Rough run time per engine after start-up at 1000 prompts: the 2026-12-01 figures."""


WORKLOADS = {
    "b1": Workload("latency1", "latency", 1, 1024, 128, 0.0, 5),
    "b64": Workload("latency64", "latency", 64, 1024, 128, 0.0, 8),
    "t1000": Workload("t1000", "throughput", 1000, 1000, 1000, 1.0, 110),
    "t2048": Workload("t2048", "throughput", 1000, 2048, 128, 1.0, 65),
}
ORDER = [*WORKLOADS, "cold", "start"]
"""Table rows: ``cold`` is each engine's first start-up with empty caches, ``start`` a later
(warm) one; a start-up is the time to build the engine (``LLM(...)``), after the imports."""
START_ESTIMATE_S = {"pagedserve": (32, 20), "vllm": (84, 22)}
"""(cold, warm) start-up seconds, 2026-12-01."""


@dataclass(frozen=True)
class Run:
    engine: str
    workloads: tuple[str, ...]
    max_num_seqs: int

    def estimate_s(self, num_prompts: int | None, cold: bool) -> float:
        cold_s, warm_s = START_ESTIMATE_S[self.engine]
        work = 0.0
        for name in self.workloads:
            w = WORKLOADS[name]
            scale = 1.0 if w.kind == "latency" or num_prompts is None else num_prompts / w.size
            work += w.estimate_s * scale
        return (cold_s if cold else warm_s) + work


def comma_list(kind: type) -> Any:
    def parse(text: str) -> list:
        return [kind(x) for x in text.split(",") if x]
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the engines, then print the table")
    run.add_argument("--out", required=True)
    run.add_argument("--peer", default=".peer-vllm",
                     help="the payload benchmarks/peers/vllm/prepare.sh builds (its "
                     "llama3-8b/config.json is the model of both engines)")
    run.add_argument("--vllm-bench", default=str(VLLM_BENCH), help=argparse.SUPPRESS)
    run.add_argument("--engines", type=comma_list(str), default=list(ENGINES))
    run.add_argument("--workloads", type=comma_list(str), default=[*WORKLOADS, "cold"])
    run.add_argument("--max-num-seqs", type=comma_list(int), default=[256, 1024])
    run.add_argument("--num-prompts", type=int, default=None,
                     help="prompts of t1000 / t2048 (default 1000)")
    run.add_argument("--first-only", type=comma_list(str), default=[],
                     help="throughput workloads to run at the first --max-num-seqs value only "
                     "(as the step workloads are), to fit a device call")
    add_precision_arguments(run)
    run.add_argument("--vllm-pythonpath", default="/tmp/site:/tmp/vllm-pkg")
    run.add_argument("--timeout", type=float, default=590, help="seconds per subprocess")
    run.add_argument("--plan", action="store_true", help="print the runs and estimates only")
    table = sub.add_parser("table", help="print the table of earlier runs")
    table.add_argument("dirs", nargs="+")
    child = sub.add_parser("child", help=argparse.SUPPRESS)  # one pagedserve engine
    child.add_argument("--model", required=True)
    child.add_argument("--workloads", type=comma_list(str), required=True)
    child.add_argument("--max-num-seqs", type=int, required=True)
    child.add_argument("--num-prompts", type=int, default=None)
    add_precision_arguments(child)
    args = parser.parse_args(argv)
    for name in getattr(args, "workloads", []):
        if name not in [*WORKLOADS, "cold"]:
            parser.error(f"--workloads: {name!r} is not one of {', '.join([*WORKLOADS, 'cold'])}")
    for name in getattr(args, "first_only", []):
        if name not in WORKLOADS:
            parser.error(f"--first-only: {name!r} is not one of {', '.join(WORKLOADS)}")
    for name in getattr(args, "engines", []):
        if name not in ENGINES:
            parser.error(f"--engines: {name!r} is not one of {', '.join(ENGINES)}")
    return args


def add_precision_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantization", choices=["fp8"], default=None,
                        help="FP8 weights, quantized at load (both engines)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="fp8: an FP8 (e4m3) KV cache (both engines)")


def precision(args: argparse.Namespace) -> str:
    """The table's name for the weights and KV cache of a run: ``bf16`` or e.g. ``fp8 weights
    + fp8 KV``."""
    parts = [f"{args.quantization} weights"] if args.quantization else []
    parts += [f"{args.kv_cache_dtype} KV"] if args.kv_cache_dtype != "auto" else []
    return " + ".join(parts) or "bf16"


def plan(args: argparse.Namespace) -> list[Run]:
    """pagedserve: one run per --max-num-seqs value; vLLM: one per workload and value. The
    step workloads and ``--first-only`` ones run at the first value only; ``cold`` needs no run
    of its own."""
    first_only = set(getattr(args, "first_only", []))
    at_first = [w for w in args.workloads
                if w in WORKLOADS and (WORKLOADS[w].kind == "latency" or w in first_only)]
    at_every = [w for w in args.workloads if w in WORKLOADS and w not in at_first]
    first = args.max_num_seqs[0]
    runs = []
    for engine in args.engines:
        for seqs in args.max_num_seqs:
            names = (at_first if seqs == first else []) + at_every
            if engine == "pagedserve":
                runs += [Run(engine, tuple(names), seqs)] if names else []
            else:
                runs += [Run(engine, (name,), seqs) for name in names]
        if "cold" in args.workloads and not any(r.engine == engine for r in runs):
            runs.append(Run(engine, (), first))  # a start-up alone
    return runs


def starts_cold(runs: list[Run], i: int, args: argparse.Namespace) -> bool:
    """Whether ``runs[i]`` is its engine's first, with ``cold`` asked for."""
    return "cold" in args.workloads and all(r.engine != runs[i].engine for r in runs[:i])


def print_plan(runs: list[Run], args: argparse.Namespace) -> float:
    total = 0.0
    for i, run in enumerate(runs):
        cold = starts_cold(runs, i, args)
        seconds = run.estimate_s(args.num_prompts, cold)
        total += seconds
        print(f"{run.engine:10} --max-num-seqs {run.max_num_seqs:5}  "
              f"{','.join(run.workloads) or 'start-up only':28} ~{seconds:4.0f} s"
              + (" (cold start)" if cold else ""))
    print(f"total ~{total:.0f} s (estimates from the 2026-12-01 H200 figures)")
    return total


# -- running -----------------------------------------------------------------------------------

def cold_cache_env(root: Path, engine: str) -> dict[str, str]:
    """Fresh compile caches for one engine (kept for its later runs: those start warm)."""
    base = root / engine
    return {"XDG_CACHE_HOME": str(base / "xdg"), "TRITON_CACHE_DIR": str(base / "triton"),
            "TORCHINDUCTOR_CACHE_DIR": str(base / "inductor"),
            "VLLM_CACHE_ROOT": str(base / "vllm")}


def command(run: Run, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    model = str(Path(args.peer) / "llama3-8b")
    prompts = [] if args.num_prompts is None else ["--num-prompts", str(args.num_prompts)]
    if run.engine == "pagedserve":
        return ([sys.executable, str(Path(__file__).resolve()), "child", "--model", model,
                 "--workloads", ",".join(run.workloads), "--max-num-seqs",
                 str(run.max_num_seqs), *prompts, *precision_flags(args)], {})
    name = WORKLOADS[run.workloads[0]].peer_name if run.workloads else "latency1"
    return ([sys.executable, args.vllm_bench, "--model", model, "--workload", name,
             "--max-num-seqs", str(run.max_num_seqs), "--repeats", "2", "--no-tqdm", *prompts,
             *precision_flags(args)], {"PYTHONPATH": args.vllm_pythonpath})


def precision_flags(args: argparse.Namespace) -> list[str]:
    quantization = ["--quantization", args.quantization] if args.quantization else []
    return [*quantization, "--kv-cache-dtype", args.kv_cache_dtype]


def vllm_records(run: Run, result: dict[str, Any]) -> list[dict[str, Any]]:
    records = [start_record("vllm", run, result["startup_s"])]
    for name in run.workloads:
        value = result.get("decode_ms_per_step", result.get("output_tokens_per_s"))
        records.append(record("vllm", name, run.max_num_seqs, value, result))
    return records


def record(engine: str, workload: str, seqs: int, value: float, raw: dict) -> dict[str, Any]:
    """One figure (``run_all`` adds its run's ``precision``; a record without one is bf16)."""
    return {"engine": engine, "workload": workload, "max_num_seqs": seqs, "value": value,
            "unit": unit_of(workload), "raw": raw}


def start_record(engine: str, run: Run, seconds: float) -> dict[str, Any]:
    return record(engine, "start", run.max_num_seqs, seconds, {"workloads": run.workloads})


def execute(run: Run, args: argparse.Namespace, env: dict[str, str]) -> list[dict[str, Any]]:
    argv, extra = command(run, args)
    print(f"[vs_vllm] {run.engine}: {' '.join(argv)}", flush=True)
    try:
        done = run_timed(argv, {**os.environ, **env, **extra}, args.timeout)
    except subprocess.TimeoutExpired:
        return [record(run.engine, "error", run.max_num_seqs, 0.0,
                       {"workloads": run.workloads, "error": f"timeout {args.timeout} s"})]
    stdout = "".join(line for _, line in done.lines)
    print(stdout[-3000:] + done.stderr[-3000:], flush=True)
    if run.engine == "pagedserve":
        return [json.loads(line[len(CHILD_TAG):]) for line in stdout.splitlines()
                if line.startswith(CHILD_TAG)]
    last = [line for line in stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not last:
        return [record("vllm", "error", run.max_num_seqs, 0.0,
                       {"workloads": run.workloads, "returncode": done.returncode})]
    result = json.loads(last[-1])
    result.update(vllm_energy(done, result))
    return vllm_records(run, result)


@dataclass
class TimedRun:
    """A finished child: its stdout lines with the time each arrived, and the card's energy
    counter sampled while it ran (empty where NVML cannot be read)."""

    returncode: int
    lines: list[tuple[float, str]]
    stderr: str
    energy: list[tuple[float, float]]
    """(time.perf_counter(), joules of NVML's total energy counter)."""


def run_timed(argv: list[str], env: dict[str, str], timeout: float) -> TimedRun:
    read_energy = nvml_energy_reader()
    energy: list[tuple[float, float]] = []
    stop = threading.Event()

    def sample() -> None:
        while read_energy is not None and not stop.wait(ENERGY_INTERVAL_S):
            energy.append((time.perf_counter(), read_energy()))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        lines: list[tuple[float, str]] = []
        deadline = time.perf_counter() + timeout
        assert child.stdout is not None
        for line in child.stdout:  # the child's prints arrive as they are flushed
            lines.append((time.perf_counter(), line))
            if time.perf_counter() > deadline:
                child.kill()
                raise subprocess.TimeoutExpired(argv, timeout)
        child.wait(timeout=max(1.0, deadline - time.perf_counter()))
        stop.set()
        err.seek(0)
        return TimedRun(child.returncode, lines, err.read(), energy)


ENERGY_INTERVAL_S = 0.1
VLLM_READY_LINE = "[bench] LLM() constructed"
"""bench_vllm.py prints this right before its timed ``generate`` starts."""


def nvml_energy_reader() -> Any:
    """Card 0's total energy counter in joules, without initialising CUDA in this process (the
    child owns the card), or None where NVML cannot read it."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    except Exception:  # noqa: BLE001 - no pynvml, no driver, no counter
        return None
    return lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3


def energy_between(energy: list[tuple[float, float]], start: float, end: float) -> float | None:
    """Joules between two times, from the counter's samples (linear between samples)."""
    if len(energy) < 2 or not energy[0][0] <= start < end <= energy[-1][0]:
        return None
    times = [t for t, _ in energy]

    def at(when: float) -> float:
        i = max(1, next(k for k, t in enumerate(times) if t >= when))
        (t0, e0), (t1, e1) = energy[i - 1], energy[i]
        return e0 + (e1 - e0) * (when - t0) / (t1 - t0) if t1 > t0 else e1

    return at(end) - at(start)


def vllm_energy(done: TimedRun, result: dict[str, Any]) -> dict[str, Any]:
    """The card's energy over vLLM's timed throughput ``generate``: it starts when the ready
    line arrives and lasts the ``wall_s`` the child reports (the same window as
    pagedserve's own NVML reading in ``bench throughput``)."""
    ready = [t for t, line in done.lines if line.startswith(VLLM_READY_LINE)]
    if "wall_s" not in result or not ready:
        return {}
    joules = energy_between(done.energy, ready[0], ready[0] + float(result["wall_s"]))
    if not joules:
        return {}
    return {"energy_j": round(joules, 1),
            "output_tok_per_j": round(result["output_tokens"] / joules, 3)}


def run_all(args: argparse.Namespace) -> None:
    runs = plan(args)
    print_plan(runs, args)
    if args.plan:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    caches = Path(tempfile.mkdtemp(prefix="vs_vllm_caches_"))
    for i, run in enumerate(runs):
        env = cold_cache_env(caches, run.engine) if "cold" in args.workloads else {}
        for rec in execute(run, args, env):
            rec["precision"] = precision(args)
            if rec["workload"] == "start":
                rec["workload"] = "cold" if starts_cold(runs, i, args) else "start"
            with open(out / RESULTS, "a") as f:
                f.write(json.dumps(rec, default=str) + "\n")
    print(format_table(read_records([out])))


# -- the pagedserve child --------------------------------------------------------------------

def child(args: argparse.Namespace) -> None:
    """One pagedserve engine at the shared settings, running ``args.workloads`` in order."""
    from pagedserve.entrypoints.bench import latency, throughput
    from pagedserve.entrypoints.bench.common import make_llm

    engine = ["--model", args.model, "--load-format", "dummy", "--dtype", "bfloat16",
              "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0",
              "--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION),
              "--max-num-seqs", str(args.max_num_seqs), *precision_flags(args)]
    start = time.perf_counter()  # as bench_vllm.py times LLM(...), after the imports
    llm = make_llm(bench_args(["latency", *engine]))
    run = Run("pagedserve", tuple(args.workloads), args.max_num_seqs)
    emit(start_record("pagedserve", run, time.perf_counter() - start))
    for name in args.workloads:
        w = WORKLOADS[name]
        shape = ["--input-len", str(w.input_len), "--output-len", str(w.output_len),
                 "--temperature", str(w.temperature)]
        if w.kind == "latency":
            result = latency.run(llm, bench_args(
                ["latency", *engine, *shape, "--batch-size", str(w.size), "--num-iters", "2"]))
            emit(record("pagedserve", name, args.max_num_seqs, result["decode_step_ms"], result))
        else:
            prompts = str(args.num_prompts or w.size)
            result = throughput.run(llm, bench_args(
                ["throughput", *engine, *shape, "--num-prompts", prompts]))
            emit(record("pagedserve", name, args.max_num_seqs, result["output_tok_per_s"],
                        result))


def bench_args(argv: list[str]) -> argparse.Namespace:
    from pagedserve.entrypoints.cli import build_parser

    parser, _ = build_parser("bench")
    return parser.parse_args(["bench", *argv])


def emit(rec: dict[str, Any]) -> None:
    print(CHILD_TAG + json.dumps(rec, default=str), flush=True)


# -- the table ---------------------------------------------------------------------------------

def read_records(dirs: list[Path]) -> list[dict[str, Any]]:
    records = []
    for d in dirs:
        path = Path(d) / RESULTS
        if path.exists():
            records += [json.loads(line) for line in path.read_text().splitlines() if line]
    return records


Key = tuple[str, int, str]
"""(workload, max_num_seqs, precision) of a table row."""


def figures(records: list[dict[str, Any]]) -> dict[Key, dict[str, float]]:
    """Row key -> engine -> value; the last record of a key wins (a cold start-up has no
    --max-num-seqs: 0)."""
    table: dict[Key, dict[str, float]] = {}
    for rec in records:
        name, engine = rec["workload"], rec["engine"]
        if name != "error":
            seqs = 0 if name == "cold" else rec["max_num_seqs"]
            table.setdefault((name, seqs, rec.get("precision", "bf16")), {})[engine] = float(
                rec["value"])
    return table


def unit_of(name: str) -> str:
    if name in WORKLOADS:
        return "ms" if WORKLOADS[name].kind == "latency" else "output tok/s"
    return "s"


def format_table(records: list[dict[str, Any]]) -> str:
    rows = ["| workload | --max-num-seqs | pagedserve | vLLM | pagedserve / vLLM |",
            "|---|---|---|---|---|"]
    table, energy = figures(records), tokens_per_joule(records)
    for key in sorted(table, key=lambda k: (k[2] != "bf16", k[2], ORDER.index(k[0]), k[1])):
        name, seqs, kind = key
        label = name if kind == "bf16" else f"{name}, {kind}"
        rows.append(table_row(f"{label} ({unit_of(name)})", seqs, table[key], unit_of(name)))
        if key in energy:
            rows.append(table_row(f"{label} (output tok/J)", seqs, energy[key], "tok/J"))
    errors = [r for r in records if r["workload"] == "error"]
    rows += [f"error: {r['engine']} {r['raw']}" for r in errors]
    return "\n".join(rows)


def table_row(label: str, seqs: int, values: dict[str, float], unit: str) -> str:
    ours, theirs = values.get("pagedserve"), values.get("vllm")
    ratio = "—" if ours is None or not theirs else (
        f"{ours / theirs:.2f}x" + (" the time" if unit in ("ms", "s") else ""))
    return f"| {label} | {seqs or '—'} | {fmt(ours)} | {fmt(theirs)} | {ratio} |"


def tokens_per_joule(records: list[dict[str, Any]]) -> dict[Key, dict[str, float]]:
    """Row key -> engine -> output tokens per joule, where it was measured."""
    table: dict[Key, dict[str, float]] = {}
    for rec in records:
        value = (rec.get("raw") or {}).get("output_tok_per_j")
        if value and rec["workload"] in WORKLOADS:
            key = (rec["workload"], rec["max_num_seqs"], rec.get("precision", "bf16"))
            table.setdefault(key, {})[rec["engine"]] = value
    return table


def fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:,.2f}" if value < 100 else f"{value:,.0f}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.command == "run":
        run_all(args)
    elif args.command == "table":
        print(format_table(read_records([Path(d) for d in args.dirs])))
    else:
        child(args)


if __name__ == "__main__":
    main()
