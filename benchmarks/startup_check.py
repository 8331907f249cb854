"""Start-up to ready on one GPU, cold and warm, and the memory the engine leaves free.

``python benchmarks/startup_check.py --out DIR`` on one CUDA card:
1. starts the Llama-3-8B shape (dummy bf16 weights) twice, each in a fresh subprocess sharing
   one fresh compile cache (``XDG_CACHE_HOME`` and ``TRITON_CACHE_DIR`` in a temporary
   folder): cold, then warm. Each start reports its phases (the engine's start-up log records)
   and its time to ready, counted from before ``import torch``, with the moments the imports
   finished, and the Triton kernels compiled in the engine's process (Triton's compilation
   listener: per kernel, how many variants and seconds, cache hits apart; Inductor compiles
   its kernels in worker processes, inside the ``compile`` phase);
2. reports the CUDA-graph memory the KV budget subtracted (PIECEWISE measured + FULL estimate)
   next to what the graphs hold after the real capture, and the KV cache's bytes;
3. checks the free memory right after start-up and after the largest step (the allocator keeps
   its peak reserved) against ``(1 - gpu_memory_utilization) x card - baseline - tolerance``,
   the baseline being what was in use before the engine (its process's CUDA context); the
   card-wide margin, without the baseline, is reported too;
4. generates 8 greedy prompts and compares them with an ``enforce_eager`` run in a third
   subprocess: equal tokens, or vLLM's logprobs-close rule (random weights give near-ties,
   so bf16 rounding may pick the other one of two equal logits).
Everything goes to DIR/startup_check.json; each subprocess has a time limit, so the whole run
stays near four minutes.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # a child's time to ready counts from here: before torch is imported

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from pagedserve.compilation.phase_log import (  # noqa: E402  (no torch: logging only)
    FIGURES_FIELD,
    KV_BUDGET_FIELD,
    PHASE_FIELD,
    SECONDS_FIELD,
)

CONFIGS = Path(__file__).resolve().parent / "model-configs"
PROMPT_LENS = [600, 17, 130, 300, 1, 45, 1000, 250]
RESULT_PREFIX = "RESULT "
GIB = 2**30
TARGETS_S = {"cold": 60.0, "warm": 25.0}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--shape", default="llama-3-8b.json",
                        help="config file in benchmarks/model-configs")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--num-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--free-tolerance-gib", type=float, default=0.25,
                        help="how far below (1 - utilization) x card the free memory may go")
    parser.add_argument("--timeouts", default="130,90,60",
                        help="seconds for the cold, warm and eager subprocesses")
    parser.add_argument("--budget-step-graph", action="store_true",
                        help="engine option: also capture the token budget's PIECEWISE graph")
    parser.add_argument("--child", choices=["fast", "eager"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--prompts-file", help=argparse.SUPPRESS)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise SystemExit(f"--gpu-memory-utilization: must be in (0, 1], got "
                         f"{args.gpu_memory_utilization}")
    timeouts = [float(t) for t in args.timeouts.split(",")]
    if len(timeouts) != 3 or min(timeouts) <= 0:
        raise SystemExit(f"--timeouts: three positive numbers (cold,warm,eager), got "
                         f"{args.timeouts!r}")
    args.timeouts = dict(zip(("cold", "warm", "eager"), timeouts, strict=True))
    if args.child and not (args.model_dir and args.prompts_file):
        raise SystemExit("--child needs --model-dir and --prompts-file")
    return args


def divergence_margins(a: dict, b: dict, step: int) -> dict[str, float | bool]:
    """Where ``a`` and ``b`` chose different tokens at ``step``: on each side, how much more
    likely (log-probability, nats) its own token was than the other side's token. When the
    other token is not in a side's top-k, its margin is a lower bound (the top-1 minus the k-th
    log-probability) and ``<side>_bound`` is True. ``a`` / ``b`` as for ``logprobs_close``, with
    "lp": [[log-probabilities in the order of "top"], ...]."""
    out: dict[str, float | bool] = {}
    for name, side, other in (("a", a, b), ("b", b, a)):
        lps = dict(zip(side["top"][step], side["lp"][step], strict=True))
        own, theirs = lps[side["tokens"][step]], lps.get(other["tokens"][step])
        out[name] = round(own - (min(lps.values()) if theirs is None else theirs), 4)
        out[f"{name}_bound"] = theirs is None
    return out


def logprobs_close(a: dict, b: dict) -> tuple[bool, int]:
    """vLLM's check_logprobs_close on one prompt: equal tokens up to the first divergence,
    where each side's token must be in the other's top-k. Returns (ok, first divergence or
    -1). ``a`` / ``b``: {"tokens": [...], "top": [[ids of step 0's top-k], ...]}."""
    for i, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"], strict=False)):
        if ta != tb:
            return tb in a["top"][i] and ta in b["top"][i], i
    return len(a["tokens"]) == len(b["tokens"]), -1


# ---- the child: one engine start in this process ----------------------------------------------


class PhaseCollector(logging.Handler):
    """Keeps the start-up records: pagedserve's ``log_phase`` fields, the engine core's
    ``engine start-up: <phase> took <s> s`` lines and the KV budget's terms."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.phases: list[dict[str, Any]] = []
        self.kv_budget: dict[str, Any] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        phase = getattr(record, PHASE_FIELD, None)
        if phase is not None:
            self.phases.append({"phase": phase,
                                "seconds": round(getattr(record, SECONDS_FIELD), 3),
                                **getattr(record, FIGURES_FIELD, {})})
        elif str(record.msg).startswith("engine start-up:") and record.args:
            name, seconds = record.args
            self.phases.append({"phase": f"engine: {name}", "seconds": round(seconds, 3)})
        budget = getattr(record, KV_BUDGET_FIELD, None)
        if budget is not None:
            self.kv_budget = budget


def _greedy(llm: Any, prompts: list[list[int]], num_tokens: int) -> list[dict]:
    from pagedserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids),
             "top": [list(step) for step in o.outputs[0].logprobs],
             "lp": [[lp.logprob for lp in step.values()] for step in o.outputs[0].logprobs]}
            for o in outputs]


class TritonCompiles:
    """Triton's compilation listener (``triton.knobs.compilation.listener``): each kernel
    variant compiled in this process, or found in Triton's cache, with its compile time."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def __call__(self, *, src: Any, metadata: Any, metadata_group: Any, times: Any,
                 cache_hit: bool) -> None:
        self.records.append({"kernel": getattr(src, "name", "?"), "cache_hit": cache_hit,
                             "seconds": times.total / 1e6,
                             "done_at_s": time.perf_counter() - _T0})

    def summary(self, top: int = 12) -> dict[str, Any]:
        """Compiles and cache hits, their seconds, and the ``top`` kernels by compile time."""
        compiled = [r for r in self.records if not r["cache_hit"]]
        by_kernel: dict[str, dict[str, float]] = {}
        for r in compiled:
            entry = by_kernel.setdefault(r["kernel"], {"variants": 0, "seconds": 0.0})
            entry["variants"] += 1
            entry["seconds"] = round(entry["seconds"] + r["seconds"], 3)
        ranked = sorted(by_kernel.items(), key=lambda kv: -kv[1]["seconds"])
        return {"compiled": len(compiled),
                "compile_seconds": round(sum(r["seconds"] for r in compiled), 3),
                "cache_hits": len(self.records) - len(compiled),
                "first_done_at_s": round(min((r["done_at_s"] for r in compiled), default=0), 2),
                "last_done_at_s": round(max((r["done_at_s"] for r in compiled), default=0), 2),
                "by_kernel": dict(ranked[:top])}


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    collector = PhaseCollector()
    package_logger = logging.getLogger("pagedserve")
    package_logger.setLevel(logging.INFO)
    package_logger.addHandler(collector)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)  # pagedserve's INFO lines too
    import torch

    marks = {"torch imported": time.perf_counter() - _T0}
    import triton

    compiles = TritonCompiles()
    triton.knobs.compilation.listener = compiles

    from pagedserve import LLM
    from pagedserve.entrypoints.bench.memory_report import free_at_largest_step, memory_report

    marks["pagedserve imported"] = time.perf_counter() - _T0

    prompts = json.loads(Path(args.prompts_file).read_text())
    llm = LLM(model=args.model_dir, load_format="dummy", dtype="bfloat16",
              skip_tokenizer_init=True, max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization,
              enforce_eager=args.child == "eager", budget_step_graph=args.budget_step_graph)
    ready_s = time.perf_counter() - _T0
    free_after_start, total = torch.cuda.mem_get_info()
    result: dict[str, Any] = {
        "ready_s": round(ready_s, 2), "phases": collector.phases,
        "marks": {k: round(v, 2) for k, v in marks.items()},
        "triton_compiles": compiles.summary(),
        "kv_budget": collector.kv_budget, "card_bytes": total,
        "free_after_start_bytes": free_after_start, **memory_report(llm),
        # Before any request: the step needs every request slot.
        "free_at_largest_step_bytes": free_at_largest_step(llm),
    }
    result["greedy"] = _greedy(llm, prompts, args.num_tokens)
    return result


# ---- the parent: three subprocesses, then the checks ------------------------------------------


def _run_subprocess(name: str, argv: list[str], env: dict[str, str], timeout: float) -> dict:
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, __file__, *argv], env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # run() killed the child: its memory is free again
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        return {"error": f"timed out after {timeout:.0f} s", "stderr_tail": (err or "")[-3000:]}
    wall = round(time.perf_counter() - start, 2)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return {**json.loads(line[len(RESULT_PREFIX):]), "wall_s": wall}
    return {"error": f"{name}: exit {proc.returncode}, no result", "wall_s": wall,
            "stderr_tail": proc.stderr[-3000:]}


def memory_checks(fast: dict, util: float, tolerance: int) -> dict[str, Any]:
    """The engine may use ``util`` of the card on top of what was in use before it (its
    process's CUDA context): free memory must stay above ``(1 - util) x card - baseline``."""
    card, baseline = fast["card_bytes"], fast["memory_baseline_bytes"]
    target = int((1.0 - util) * card) - baseline - tolerance
    at_peak = fast.get("free_at_largest_step_bytes")
    graphs = fast.get("graphs", {})
    return {
        "target_free_bytes": target,
        "baseline_gib": round(baseline / GIB, 3),
        "free_after_start_ok": fast["free_after_start_bytes"] >= target,
        "free_at_largest_step_ok": None if at_peak is None else at_peak >= target,
        "margin_at_largest_step_gib": None if at_peak is None else round((at_peak - target)
                                                                         / GIB, 3),
        "card_wide_margin_at_largest_step_gib": None if at_peak is None
        else round((at_peak - (1.0 - util) * card) / GIB, 3),
        "graph_estimate_minus_actual_mib": None if graphs.get("actual_bytes") is None
        or graphs.get("estimate_bytes") is None
        else round((graphs["estimate_bytes"] - graphs["actual_bytes"]) / 2**20, 1),
    }


def _print_start(name: str, r: dict) -> None:
    if "error" in r:
        print(f"[{name}] ERROR {r['error']}\n{r.get('stderr_tail', '')}", flush=True)
        return
    for mark, at in r.get("marks", {}).items():
        print(f"[{name}] {mark:<28} at {at:5.2f} s", flush=True)
    for p in r["phases"]:
        print(f"[{name}] {p['phase']:<28} {p['seconds']:8.2f} s", flush=True)
    if "triton_compiles" in r:
        t = r["triton_compiles"]
        print(f"[{name}] Triton, in process: {t['compiled']} variants compiled in "
              f"{t['compile_seconds']:.1f} s (done {t['first_done_at_s']}..{t['last_done_at_s']} s), "
              f"{t['cache_hits']} cache hits; by kernel: "
              + ", ".join(f"{k} {v['variants']}x {v['seconds']:.1f} s" for k, v in t["by_kernel"].items()),
              flush=True)
    target = TARGETS_S.get(name)
    verdict = "" if target is None else f" (target <= {target:.0f} s: " \
        f"{'met' if r['ready_s'] <= target else 'NOT met'})"
    print(f"[{name}] ready in {r['ready_s']:.1f} s{verdict}; subprocess wall {r['wall_s']} s",
          flush=True)


def run_parent(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="startup_check_"))
    model_dir = work / args.shape.removesuffix(".json")
    model_dir.mkdir()
    shutil.copy(CONFIGS / args.shape, model_dir / "config.json")
    rng = random.Random(1)
    prompts = [[rng.randrange(10, 32000) for _ in range(n)] for n in PROMPT_LENS]
    (work / "prompts.json").write_text(json.dumps(prompts))
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(XDG_CACHE_HOME=str(work / "xdg"), TRITON_CACHE_DIR=str(work / "triton"))
    common = ["--model-dir", str(model_dir), "--prompts-file", str(work / "prompts.json"),
              "--gpu-memory-utilization", str(args.gpu_memory_utilization),
              "--max-model-len", str(args.max_model_len), "--num-tokens", str(args.num_tokens),
              *(["--budget-step-graph"] if args.budget_step_graph else [])]
    report: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "child"}}
    for name, mode in (("cold", "fast"), ("warm", "fast"), ("eager", "eager")):
        report[name] = _run_subprocess(name, ["--child", mode, *common], env,
                                       args.timeouts[name])
        _print_start(name, report[name])
    report["checks"] = _checks(report, args)
    (out / "startup_check.json").write_text(json.dumps(report, indent=1, default=str))
    shutil.rmtree(work, ignore_errors=True)
    return report


def _checks(report: dict, args: argparse.Namespace) -> dict[str, Any]:
    checks: dict[str, Any] = {}
    for name, target in TARGETS_S.items():
        r = report[name]
        checks[f"{name}_ready_s"] = r.get("ready_s")
        checks[f"{name}_target_met"] = "ready_s" in r and r["ready_s"] <= target
    cold, warm, eager = report["cold"], report["warm"], report["eager"]
    fast = warm if "error" not in warm else cold  # memory does not depend on the cache
    if "error" not in fast:
        checks["memory"] = memory_checks(fast, args.gpu_memory_utilization,
                                          int(args.free_tolerance_gib * GIB))
        checks["graphs"] = {k: fast["graphs"].get(k) for k in
                            ("estimate_bytes", "actual_bytes", "captured", "num_compiles")}
        checks["kv_cache_gib"] = round(fast["kv_cache_bytes"] / GIB, 2)
        g = fast["graphs"]
        print(f"[memory] graphs: estimate {_gib(g.get('estimate_bytes'))} GiB, actual "
              f"{_gib(g.get('actual_bytes'))} GiB; KV cache {checks['kv_cache_gib']} GiB; free "
              f"after start {_gib(fast['free_after_start_bytes'])} GiB, at the largest step "
              f"{_gib(fast['free_at_largest_step_bytes'])} GiB, target >= "
              f"{_gib(checks['memory']['target_free_bytes'])} GiB", flush=True)
    if "error" not in cold and "error" not in warm:
        checks["cold_equals_warm"] = cold["greedy"] == warm["greedy"]
    if "error" not in fast and "error" not in eager:
        pairs = list(zip(fast["greedy"], eager["greedy"], strict=True))
        close = [logprobs_close(a, b) for a, b in pairs]
        checks["greedy_equal"] = [a["tokens"] == b["tokens"] for a, b in pairs]
        checks["logprobs_close"] = all(ok for ok, _ in close)
        checks["first_divergence"] = [i for _, i in close]
        # how near the tie was at each divergence (graphs side "a", eager side "b")
        checks["divergence_margins_nats"] = [
            divergence_margins(a, b, i) if i >= 0 else None
            for (a, b), (_, i) in zip(pairs, close, strict=True)
        ]
    print("[checks] " + json.dumps(checks), flush=True)
    return checks


def _gib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / GIB:.3f}"


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.child:
        print(RESULT_PREFIX + json.dumps(run_child(args), default=str), flush=True)
        return
    run_parent(args)


if __name__ == "__main__":
    main(sys.argv[1:])
