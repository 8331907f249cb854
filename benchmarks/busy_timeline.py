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
``--repeat 2`` runs the workload twice in the same process: the second run shows the engine
with every kernel already compiled. Everything goes to DIR/busy_timeline.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pagedserve.entrypoints.bench import throughput
from pagedserve.entrypoints.bench.gpu_busy import busy_union_us
from pagedserve.entrypoints.cli import build_parser

CONFIGS = Path(__file__).resolve().parent / "model-configs"
BUCKETS = (1, 16, 64, 128, 192, 256)



def per_tenth(intervals: list[tuple[float, float]], t0: float, t1: float) -> list[float]:
    """Busy fraction of each tenth of [t0, t1) (kernel clock, us)."""
    edges = np.linspace(t0, t1, 11)
    fractions = []
    for lo, hi in zip(edges[:-1], edges[1:]):
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


class StepLog:
    """Wraps ``EngineCore.step``: (start s, end s, running requests) of every step."""

    def __init__(self, core) -> None:  # noqa: ANN001
        self.steps: list[tuple[float, float, int]] = []
        self._core, self._step = core, core.step
        core.step = self._logged

    def _logged(self):  # noqa: ANN202
        running = len(self._core.scheduler.running)
        start = time.perf_counter()
        out = self._step()
        self.steps.append((start, time.perf_counter(), running))
        return out

    def summary(self, t0: float, t1: float) -> dict:
        edges = np.linspace(t0, t1, 11)
        tenths = []
        for lo, hi in zip(edges[:-1], edges[1:]):
            inside = [s for s in self.steps if lo <= s[0] < hi]
            tenths.append({"steps": len(inside),
                           "mean_running": round(float(np.mean([s[2] for s in inside])), 1)
                           if inside else 0})  # fmt: skip
        by_batch = {}
        for lo, hi in zip(BUCKETS[:-1], BUCKETS[1:]):
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
    compiles = CompileLog()
    reports = [profiled_run(llm, bench.parse_args([*common, *args.workload.split()]), compiles)
               for _ in range(args.repeat)]  # fmt: skip
    for report in reports:
        print(json.dumps(report, indent=1), flush=True)
    summary = {"config": args.config, "workload": args.workload, "runs": reports}
    (out / "busy_timeline.json").write_text(json.dumps(summary, indent=1))


def profiled_run(llm, workload: argparse.Namespace, compiles: CompileLog) -> dict:  # noqa: ANN001
    from torch.profiler import ProfilerActivity, profile

    log = StepLog(llm.engine_core)
    compiles.take()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        result = throughput.run(llm, workload)
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    llm.engine_core.step = log._step  # unwrap
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
    }  # fmt: skip


if __name__ == "__main__":
    main()
