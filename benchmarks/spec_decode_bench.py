"""Speculative decoding on a GPU: its targets, on the Llama-3-8B shape, dummy bf16.

``python benchmarks/spec_decode_bench.py --out DIR [--deadline-s S]`` (or
``benchmarks/suite.py --sections spec``) runs the jobs of ``spec_decode_jobs.py``, each in a
process of its own (one engine with the whole memory share, then exit), streams their output,
and appends every figure to DIR/suite.json as it arrives (section ``spec.job``), so a run cut
short keeps what it measured. Jobs that would start past the deadline are skipped. At the end
it writes the summaries:

- ``spec.steps``: at batch 1 (1024-token prompt), the plain decode step, the verify step of
  1 + k tokens for k = 1..5 (each in an engine configured for that k, gate threshold 0, drafts
  always rejected) and the 1B draft's decode step; per k the break-even acceptance and the
  speedup at acceptance 0.8, for ngram drafts (no draft cost) and for a 1B draft model (k draft
  steps per verify).
- ``spec.e2e``: decode tok/s at batch 1 (256 tokens) against the plain engine, on the
  known-output workloads (``spec_decode_jobs.py`` says how the output is known): ngram on a
  prompt ending in a run of the known token (acceptance ~1) and drafts right with probability
  0.8 per position (acceptance 0.8), per k; with the speedup the step times predict beside.
- ``spec.b64``: batch-64 output tok/s (64 random prompts of 512, 256 out), the plain engine
  against the same settings with ngram, k = 4, defaults (it drafts at no more than 32 running
  requests): three runs each, run i of each paired, the median ratio (target >= 0.97).
- ``spec.draft_model``: the engine with the 1B-shaped draft model: its whole speculative step
  at k = 1..5 and its verify step alone (the draft's cost is the difference), break-even and
  speedup at 0.8 from the measured step, and from the draft's cost plus the verify step of an
  engine configured for that k.
- ``spec.tiny_greedy_equal``: the fast path's greedy tokens with drafts equal the CPU
  reference's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import median

RESULT_PREFIX = "SPEC_RESULT "
ACCEPTANCE = 0.8
JOBS_SCRIPT = Path(__file__).resolve().parent / "spec_decode_jobs.py"
DEADLINE_S = 400.0


def expected_tokens(a: float, k: int) -> float:
    """Tokens per verify step with per-draft acceptance ``a``: 1 + a + ... + a^k."""
    return float(sum(a**i for i in range(k + 1)))


def break_even(ratio: float, k: int) -> float | None:
    """The acceptance at which ``expected_tokens`` equals ``ratio`` (a speculative step's cost
    over a plain step's); None when even acceptance 1 does not pay."""
    if ratio <= 1.0:
        return 0.0
    if expected_tokens(1.0, k) <= ratio:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < ratio else (lo, mid)
    return round(hi, 4)


def step_figures(t_plain: float, t_verify: dict[int, float], t_draft: float | None) -> dict:
    """Per k: break-even acceptance and speedup at ACCEPTANCE, ngram and (given the draft's
    step) draft model."""
    out: dict[int, dict] = {}
    for k, t in sorted(t_verify.items()):
        e = expected_tokens(ACCEPTANCE, k)
        out[k] = {"verify_ms": t, "ngram_break_even": break_even(t / t_plain, k),
                  "ngram_speedup_at_0.8": e * t_plain / t}
        if t_draft is not None:
            cost = (t + k * t_draft) / t_plain
            out[k] |= {"draft_model_break_even": break_even(cost, k),
                       "draft_model_speedup_at_0.8": e / cost}
    return out


def parse_result_line(line: str) -> dict | None:
    """The figure of a job's ``SPEC_RESULT {json}`` line; None for any other line."""
    if not line.startswith(RESULT_PREFIX):
        return None
    try:
        value = json.loads(line[len(RESULT_PREFIX):])
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


@dataclass
class Job:
    name: str
    argv: list[str]
    """Arguments of spec_decode_jobs.py."""
    estimate_s: float
    """About how long it runs (start-up included): it is skipped past the deadline."""


def plan_jobs(target: str, draft: str, work: str) -> list[Job]:
    """In order of importance; the verify steps' k = 4 engine is the batch-64 one."""
    models = ["--target", target, "--draft", draft, "--work", work]
    jobs = [Job("plain", ["--job", "plain", *models], 70)]
    jobs += [Job(f"spec_k{k}", ["--job", "spec", "--k", str(k), *models], 60 if k == 4 else 35)
             for k in (4, 2, 3, 5, 1)]
    jobs += [Job("draft_step", ["--job", "draft_step", *models], 25),
             Job("draft_model", ["--job", "draft_model", *models], 60),
             Job("tiny", ["--job", "tiny", *models], 40)]
    return jobs


def run_job(job: Job, timeout_s: float, on_result: Callable[[dict], None]) -> int:
    """Run ``job`` in a process of its own, echo its output, hand each figure to
    ``on_result`` as it comes; kill it (its process group) after ``timeout_s``. Returns its
    exit status."""
    proc = subprocess.Popen([sys.executable, str(JOBS_SCRIPT), *job.argv], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1,
                            start_new_session=True)
    timer = threading.Timer(timeout_s, os.killpg, (proc.pid, signal.SIGKILL))
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(f"  [{job.name}] {line}", end="", flush=True)
            result = parse_result_line(line)
            if result is not None:
                on_result(result)
        return proc.wait()
    finally:
        timer.cancel()


def run_all(log: Callable[..., None], work: Path, deadline_s: float = DEADLINE_S) -> dict:
    """Every job within the deadline; logs the raw figures as they arrive, then the
    summaries. Returns the number of figures and of jobs that failed."""
    from suite import model_dir

    start = time.perf_counter()
    results: list[dict] = []
    failed = 0

    def on_result(result: dict) -> None:
        results.append(result)
        log("spec.job", **result)

    jobs = plan_jobs(model_dir(work, "llama-3-8b.json"), model_dir(work, "llama-3.2-1b.json"),
                     str(work))
    for job in jobs:
        left = deadline_s - (time.perf_counter() - start)
        if left < job.estimate_s:
            log("spec.job_skipped", job=job.name, seconds_left=round(left, 1))
            continue
        t0 = time.perf_counter()
        rc = run_job(job, left, on_result)
        failed += rc != 0
        log("spec.job_done", job=job.name, rc=rc, seconds=round(time.perf_counter() - t0, 1))
    for section, values in summarize(results).items():
        log(section, **values)
    return {"figures": len(results), "failed_jobs": failed}


def figures(results: list[dict], job: str, figure: str) -> list[dict]:
    return [r for r in results if r.get("job") == job and r.get("figure") == figure]


def step_times(results: list[dict]) -> tuple[float | None, dict[int, float], float | None]:
    """(plain step, verify step per k, draft step), in ms, where measured."""
    plain = figures(results, "plain", "step")
    draft = figures(results, "draft_step", "step")
    verify = {int(r["k"]): r["step_ms"] for r in figures(results, "spec", "verify_step")}
    return (plain[0]["step_ms"] if plain else None, verify,
            draft[0]["step_ms"] if draft else None)


def steps_summary(results: list[dict]) -> dict | None:
    t_plain, t_verify, t_draft = step_times(results)
    if t_plain is None or not t_verify:
        return None
    return {"plain_step_ms": t_plain, "draft_step_ms": t_draft,
            "per_k": step_figures(t_plain, t_verify, t_draft)}


def e2e_entry(spec: dict, plain: dict, predicted: float | None) -> dict:
    return {"decode_tok_per_s": spec["decode_tok_per_s"],
            "speedup": spec["decode_tok_per_s"] / plain["decode_tok_per_s"],
            "predicted_speedup": predicted, "acceptance": spec["acceptance"],
            "tokens_per_drafting_step": spec["tokens_per_drafting_step"],
            "known_output": spec["known_output"]}


def e2e_summary(results: list[dict]) -> dict | None:
    """Per workload and k: decode tok/s and speedup over the plain engine's same requests;
    the speedup predicted from the step times (ngram: the measured tokens per drafting step;
    iid: ``expected_tokens(p, k)``)."""
    plain = {r["workload"]: r for r in figures(results, "plain", "e2e")}
    if not plain:
        return None
    t_plain, t_verify, _ = step_times(results)
    out: dict = {"plain": {w: {"decode_tok_per_s": r["decode_tok_per_s"],
                               "known_output": r["known_output"]} for w, r in plain.items()}}
    for r in figures(results, "spec", "e2e"):
        base, k = plain.get(r["workload"]), int(r["k"])
        if base is None:
            continue
        tokens = (expected_tokens(r["p"], k) if "p" in r else r["tokens_per_drafting_step"])
        predicted = (tokens * t_plain / t_verify[k]
                     if t_plain is not None and k in t_verify else None)
        out.setdefault(r["workload"], {})[k] = e2e_entry(r, base, predicted)
    for workload in ("ngram", "iid"):
        speedups = [e["speedup"] for e in out.get(workload, {}).values()]
        if speedups:
            out[f"{workload}_best_speedup"] = max(speedups)
            out[f"{workload}_meets_2x"] = max(speedups) >= 2.0
    return out


def b64_summary(results: list[dict]) -> dict | None:
    """Run i of the plain engine against run i of the speculative one; the median ratio."""
    plain = [r["tok_per_s"] for r in sorted(figures(results, "plain", "b64"),
                                            key=lambda r: r["run"])]
    spec = sorted(figures(results, "spec", "b64"), key=lambda r: r["run"])
    if not plain or not spec:
        return None
    ratios = [s["tok_per_s"] / p for p, s in zip(plain, spec, strict=False)]
    return {"plain_tok_per_s": plain, "spec_tok_per_s": [s["tok_per_s"] for s in spec],
            "spec_drafted": [s["drafted"] for s in spec], "ratios": ratios,
            "throughput_ratio": median(ratios), "meets_0.97": median(ratios) >= 0.97}


def draft_model_summary(results: list[dict]) -> dict | None:
    """Per k: the measured speculative step, the verify step alone in the same engine and
    their difference (the draft's cost); break-even and speedup at 0.8 from the measured step,
    and from the draft's cost plus the verify step of an engine configured for that k."""
    t_plain, t_verify, _ = step_times(results)
    rows = figures(results, "draft_model", "spec_step")
    if t_plain is None or not rows:
        return None
    per_k = {}
    for r in rows:
        k, step = int(r["k"]), r["step_ms"]
        e = expected_tokens(ACCEPTANCE, k)
        entry = {"step_ms": step, "verify_only_ms": r["verify_only_ms"],
                 "draft_ms": step - r["verify_only_ms"],
                 "break_even": break_even(step / t_plain, k),
                 "speedup_at_0.8": e * t_plain / step}
        if k in t_verify:
            entry["speedup_at_0.8_with_k_verify_graph"] = (
                e * t_plain / (t_verify[k] + entry["draft_ms"]))
        per_k[k] = entry
    return {"plain_step_ms": t_plain, "per_k": per_k}


def summarize(results: list[dict]) -> dict[str, dict]:
    """The summary sections that have data."""
    tiny = figures(results, "tiny", "greedy_equal")
    sections = {"spec.steps": steps_summary(results), "spec.e2e": e2e_summary(results),
                "spec.b64": b64_summary(results),
                "spec.draft_model": draft_model_summary(results),
                "spec.tiny_greedy_equal": tiny[0] if tiny else None}
    return {name: values for name, values in sections.items() if values is not None}


def main() -> None:
    from suite import Suite

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--deadline-s", type=float, default=DEADLINE_S,
                        help="start no job that would end past this many seconds")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_all(Suite(out).log, Path(tempfile.mkdtemp()), args.deadline_s)


if __name__ == "__main__":
    main()
