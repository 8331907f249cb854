"""GPU busy time of a whole offline workload, from the kernel trace (issue #11 target 5).

``python benchmarks/busy_timeline.py --out DIR [--config qwen3-0.6b.json]`` starts the shape
with dummy bf16 weights, runs a short warm-up, then runs the throughput workload (default: the
target-5 one, 256 requests with input and output lengths uniform in 100..1024) once under
``torch.profiler`` with CUDA activity only (no host-side op recording, so the host work per step
is what it is without the profiler), and reports:

- busy = the union of all kernel intervals / the wall time of ``generate`` (NVML's figure,
  sampled every 0.1 s by the throughput bench, is printed beside it);
- the same per tenth of the run, with the steps and the mean number of running requests in
  each tenth (the tail of a workload with uneven lengths runs at small batch);
- per-step wall time by the number of requests the step ran, and the slowest steps;
- every Triton kernel compiled during the run (a first-use JIT compile stalls the GPU).
The engine runs with its defaults (which capture the budget-step graph for this model) but
for ``--gpu-memory-utilization 0.25 --max-num-seqs 256`` (``--engine-args`` replaces those). ``--repeat 2`` runs the workload twice in the same process; the second run's prompts
are the first run's, so prefix caching serves them (a different workload: use the warm-up
prompts to see an engine past its first work). ``--phases N`` also times each step's host phases (those of
``host_overhead.py``: schedule, prep, forward, sample, output, update, process) and lists the
first N steps one by one; every run lists Python's garbage collections (generation, ms, step).
``--cprofile-steps N`` runs cProfile over the first N steps of the first run and writes the top
functions (cumulative and own time) to DIR/cprofile_first_steps.txt (cProfile slows Python-heavy
code about twice: for where the host time goes, not for the busy figure). ``--freeze-gc`` calls ``gc.freeze()`` before the runs (what the engine does at start-up
otherwise: the A/B of that). ``--device-waits`` logs, per step, the ``cudaMalloc`` calls and the
synchronizing CUDA calls (with the engine frames that made them; ``device_waits.py``).
Everything goes to DIR/busy_timeline.json.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from device_waits import DeviceWaitLog
from host_overhead import PhaseTimer, instrument, split_phases
from step_wrap import wrap_step

from pagedserve.entrypoints.bench import throughput
from pagedserve.entrypoints.bench.gpu_busy import busy_union_us
from pagedserve.entrypoints.cli import build_parser

CONFIGS = Path(__file__).resolve().parent / "model-configs"
BUCKETS = (1, 16, 64, 128, 192, 256)



def per_tenth(intervals: list[tuple[float, float]], t0: float, t1: float) -> list[float]:
    """Busy fraction of each tenth of [t0, t1) (kernel clock, us)."""
    edges = np.linspace(t0, t1, 11)
    fractions = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        clipped = [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]
        fractions.append(round(busy_union_us(clipped) / (hi - lo), 3))
    return fractions


class CompileLog:
    """Times every Triton JIT compile (``JITFunction._do_compile``) while installed."""

    def __init__(self) -> None:
        from triton.runtime.jit import JITFunction

        self.compiles: list[tuple[str, float]] = []
        original = JITFunction._do_compile
        log = self.compiles

        def timed(fn, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            start = time.perf_counter()
            kernel = original(fn, *args, **kwargs)
            log.append((fn.__name__, round(time.perf_counter() - start, 3)))
            return kernel

        JITFunction._do_compile = timed

    def take(self) -> list[tuple[str, float]]:
        taken = list(self.compiles)
        self.compiles.clear()
        return taken


class GcLog:
    """Every collection of Python's cyclic garbage collector while installed: (generation, ms,
    index of the engine step it ran in)."""

    def __init__(self, steps: list) -> None:
        self.events: list[tuple[int, float, int]] = []
        self._steps, self._start = steps, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            ms = (time.perf_counter() - self._start) * 1e3
            self.events.append((info["generation"], round(ms, 2), len(self._steps)))

    def remove(self) -> dict:
        gc.callbacks.remove(self._callback)
        by_gen = {}
        for gen in range(3):
            ms = [e[1] for e in self.events if e[0] == gen]
            by_gen[f"gen{gen}"] = {"count": len(ms), "total_ms": round(sum(ms), 1),
                                   "max_ms": max(ms, default=0.0)}
        slow = sorted(self.events, key=lambda e: -e[1])[:10]
        return {**by_gen, "slowest": [{"gen": g, "ms": ms, "step": i} for g, ms, i in slow]}


class FirstStepsProfile:
    """cProfile over the first ``num_steps`` engine steps from now (0: off); writes the top
    functions to OUT/cprofile_first_steps.txt when the last of them ends."""

    def __init__(self, core, num_steps: int, out: Path) -> None:  # noqa: ANN001
        self._left, self._out = num_steps, out
        self._profile = cProfile.Profile()
        self.remove = wrap_step(core, self._profiled) if num_steps > 0 else lambda: None

    def _profiled(self, step: Callable[[], object]) -> object:
        if self._left <= 0:  # done (another wrapper may still hold this one)
            return step()
        self._profile.enable()
        try:
            return step()
        finally:
            self._profile.disable()
            self._left -= 1
            if self._left == 0:
                self._write()

    def _write(self) -> None:
        text = io.StringIO()
        stats = pstats.Stats(self._profile, stream=text)
        stats.sort_stats("cumulative").print_stats(60)
        stats.sort_stats("tottime").print_stats(40)
        (self._out / "cprofile_first_steps.txt").write_text(text.getvalue())


class StepLog:
    """Wraps ``EngineCore.step`` until ``remove()``: (start s, end s, running requests) of every
    step."""

    def __init__(self, core) -> None:  # noqa: ANN001
        self.steps: list[tuple[float, float, int]] = []
        self._core = core
        self.remove = wrap_step(core, self._logged)

    def _logged(self, step: Callable[[], object]) -> object:
        running = len(self._core.scheduler.running)
        start = time.perf_counter()
        out = step()
        self.steps.append((start, time.perf_counter(), running))
        return out

    def summary(self, t0: float, t1: float) -> dict:
        edges = np.linspace(t0, t1, 11)
        tenths = []
        for lo, hi in zip(edges[:-1], edges[1:], strict=True):
            inside = [s for s in self.steps if lo <= s[0] < hi]
            tenths.append({"steps": len(inside),
                           "mean_running": round(float(np.mean([s[2] for s in inside])), 1)
                           if inside else 0})  # fmt: skip
        by_batch = {}
        for lo, hi in zip(BUCKETS[:-1], BUCKETS[1:], strict=True):
            ms = [self._ms(s) for s in self.steps if lo <= s[2] < hi or s[2] == hi == BUCKETS[-1]]
            if ms:
                mean = round(float(np.mean(ms)), 3)
                by_batch[f"{lo}-{hi}"] = {"steps": len(ms), "mean_step_ms": mean}
        slowest = sorted(range(len(self.steps)), key=lambda i: -self._ms(self.steps[i]))[:5]
        return {"num_steps": len(self.steps), "tenths": tenths, "step_ms_by_running": by_batch,
                "slowest_steps": [{"index": i, "ms": round(self._ms(self.steps[i]), 1),
                                   "running": self.steps[i][2]} for i in slowest]}  # fmt: skip

    @staticmethod
    def _ms(step: tuple[float, float, int]) -> float:
        return (step[1] - step[0]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--config", default="qwen3-0.6b.json")
    parser.add_argument("--workload", default="--num-prompts 256 --input-len 562 "
                        "--output-len 562 --range-ratio 0.822")
    parser.add_argument("--engine-args", default="--gpu-memory-utilization 0.25 --max-num-seqs 256")
    parser.add_argument("--repeat", type=int, default=1, help="runs of the workload")
    parser.add_argument("--phases", type=int, default=0, metavar="N",
                        help="time each step's host phases; list the first N steps")
    parser.add_argument("--cprofile-steps", type=int, default=0, metavar="N",
                        help="cProfile the first N steps of the first run")
    parser.add_argument("--device-waits", action="store_true",
                        help="log each step's cudaMalloc and synchronizing CUDA calls")
    parser.add_argument("--freeze-gc", action="store_true",
                        help="gc.freeze() before the runs")
    parser.add_argument("--warmup-prompts", type=int, default=32,
                        help="prompts (200 in / 50 out) run before the measured runs; 0: none, "
                        "the first run is the engine's first work after start-up")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp())
    shutil.copy(CONFIGS / args.config, work / "config.json")
    bench, _ = build_parser("bench")
    common = ["bench", "throughput", "--model", str(work), "--load-format", "dummy",
              "--dtype", "bfloat16", "--temperature", "0", *args.engine_args.split()]
    llm = throughput.make_llm(bench.parse_args(common))
    if args.warmup_prompts > 0:
        throughput.run(llm, bench.parse_args([*common, "--num-prompts", str(args.warmup_prompts),
                                              "--input-len", "200", "--output-len", "50"]))
    if args.freeze_gc:
        gc.freeze()
    print(f"objects the collector tracks: {len(gc.get_objects())}, frozen: "
          f"{gc.get_freeze_count()}", flush=True)
    compiles = CompileLog()
    timer = PhaseTimer() if args.phases else None
    if timer is not None:
        instrument(llm, timer)
    workload = bench.parse_args([*common, *args.workload.split()])
    first_steps = FirstStepsProfile(llm.engine_core, args.cprofile_steps, out)
    reports = [profiled_run(llm, workload, compiles, timer, args.phases, args.device_waits)
               for _ in range(args.repeat)]  # fmt: skip
    first_steps.remove()
    for report in reports:
        print(json.dumps(report, indent=1), flush=True)
    summary = {"config": args.config, "workload": args.workload, "runs": reports}
    (out / "busy_timeline.json").write_text(json.dumps(summary, indent=1))


def profiled_run(llm, workload: argparse.Namespace, compiles: CompileLog,  # noqa: ANN001
                 timer: PhaseTimer | None, num_listed: int, device_waits: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    log = StepLog(llm.engine_core)
    gc_log = GcLog(log.steps)
    waits = DeviceWaitLog(llm.engine_core, log.steps) if device_waits else None
    if timer is not None:
        timer.steps.clear()
    compiles.take()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        result = throughput.run(llm, workload)
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    waits_summary = None if waits is None else waits.remove()
    log.remove()
    gc_summary = gc_log.remove()
    intervals = [(e.time_range.start, e.time_range.end) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA]
    t0 = min(s for s, _ in intervals)
    t1 = max(e for _, e in intervals)
    return {
        "throughput": result, "kernels": len(intervals), "wall_s": wall_us / 1e6,
        "busy_of_wall": busy_union_us(intervals) / wall_us,
        "busy_of_kernel_span": busy_union_us(intervals) / (t1 - t0),
        "busy_per_tenth": per_tenth(intervals, t0, t1),
        "triton_compiles": compiles.take(),
        **log.summary(start, start + wall_us / 1e6),
        "gc": gc_summary,
        **({} if waits_summary is None else {"device_waits": waits_summary}),
        **({} if timer is None else phase_summary(timer, log, num_listed)),
    }  # fmt: skip


def phase_summary(timer: PhaseTimer, log: StepLog, num_listed: int) -> dict:
    """Host phases (ms) of the first ``num_listed`` steps one by one, and their mean per
    running-requests bucket (one timer entry per engine step, in order)."""
    rows = []
    for (start, end, running), raw in zip(log.steps, timer.steps, strict=False):
        phases = {k: round(v * 1e3, 2) for k, v in split_phases(raw).items()}
        rows.append({"running": running, "ms": round((end - start) * 1e3, 2), **phases})
    by_batch = {}
    for lo, hi in zip(BUCKETS[:-1], BUCKETS[1:], strict=True):
        inside = [r for r in rows if lo <= r["running"] < hi or r["running"] == hi == BUCKETS[-1]]
        if inside:
            by_batch[f"{lo}-{hi}"] = {k: round(float(np.mean([r[k] for r in inside])), 3)
                                      for k in inside[0] if k != "running"}  # fmt: skip
    return {"phases_first_steps": rows[:num_listed], "phases_by_running": by_batch}


if __name__ == "__main__":
    main()
