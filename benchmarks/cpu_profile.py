"""Where a CPU decode step's time goes: host phases, torch ops by name, op counts.

``python benchmarks/cpu_profile.py`` starts the default model on the CPU, brings ``--batch``
requests (prompts of ``--prompt-len`` tokens, default 128) to steady decoding, then

  1. times ``--steps`` engine steps with a timer around each phase (scheduler, model runner,
     the model's forward, logits, sampling, output processing): what is left of a step outside
     the forward is the host's Python per step. ``process CPU time`` is the CPU time of all
     the process's threads per step: with one thread, the figure that moves least when other
     processes share the cores (this machine has no instruction counters);
  2. profiles as many steps with ``torch.profiler`` (CPU): top-level torch ops per step, their
     count and self time by name. The C decode kernel is called through ``ctypes``: it is no
     torch op, and shows as the phase ``attention kernel`` in part 1.

Steps are driven one at a time through ``LLM.add_request`` / ``LLM.step``. Threads: whatever
the engine chooses, or ``OMP_NUM_THREADS``.

    OMP_NUM_THREADS=1 python benchmarks/cpu_profile.py --batch 1 --dtype bfloat16
    OMP_NUM_THREADS=1 python benchmarks/cpu_profile.py --one-token-step compiled  # torch layers
    OMP_NUM_THREADS=1 python benchmarks/cpu_profile.py --linears   # the bf16 linear kernel
    OMP_NUM_THREADS=1 python benchmarks/cpu_profile.py --batch 16 --prefills 6  # prompts
    OMP_NUM_THREADS=2 python benchmarks/cpu_profile.py --batch 256 --prompt-len 256  # contexts
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import SchedulerConfig


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128, help="tokens of each prompt")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--profile-steps", type=int, default=None,
                   help="steps under torch.profiler (default: --steps; 0: no profile)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--one-token-step", choices=["gemv", "compiled"], default="gemv",
                   help="gemv: decode steps in C (model/cpu_decode.py); compiled: the torch "
                        "layers")
    p.add_argument("--top", type=int, default=15, help="ops listed by self time")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--prefills", type=int, default=0,
                   help="instead: process CPU time of this many prefills of --batch 128-token "
                        "prompts, 1 token out each (after one warm-up)")
    p.add_argument("--linears", action="store_true",
                   help="instead: one layer's bf16 linears, torch against the engine's CPU "
                        "linear, at 1, 4, 64 and 2048 rows (CPU time, weights in cache)")
    return p.parse_args()


LAYER_LINEARS = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
"""(in, out) of the default model's qkv, o, gate_up and down projections."""


def linear_ms(
    linear: Callable[..., torch.Tensor], rows: int, reps: int, dtype: torch.dtype
) -> float:
    """CPU ms of one layer's four linears at ``rows`` rows (after a warm-up call)."""
    total = 0.0
    for k, n in LAYER_LINEARS:
        weight = torch.randn(n, k).to(dtype)
        x = torch.randn(rows, k).to(dtype)
        linear(x, weight)
        start = time.thread_time()
        for _ in range(reps):
            linear(x, weight)
        total += (time.thread_time() - start) / reps * 1e3
    return total


def compare_linears() -> None:
    from pagedserve.platform import platform_for

    engine = platform_for("cpu").dense_linear()
    print(f"engine's CPU linear: {type(engine).__name__}; {torch.get_num_threads()} threads")
    for rows in (1, 4, 64, 2048):
        reps = 20 if rows <= 64 else 2
        torch_linear = torch.nn.functional.linear
        ours = linear_ms(engine, rows, reps, torch.bfloat16)
        theirs = linear_ms(torch_linear, rows, reps, torch.bfloat16)
        fp32 = linear_ms(torch_linear, rows, reps, torch.float32)
        gflops = rows * sum(k * n for k, n in LAYER_LINEARS) * 2 / ours / 1e6
        print(f"{rows:5d} rows: torch bf16 {theirs:8.3f} ms, engine bf16 {ours:8.3f} ms "
              f"({gflops:.1f} GFLOP/s), torch fp32 {fp32:8.3f} ms per layer")


class PhaseTimer:
    """Wraps methods of live objects with a timer; seconds and calls per phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner: Any, attr: str, phase: str) -> None:  # noqa: ANN401
        inner: Callable[..., Any] = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start
                self.calls[phase] += 1

        setattr(owner, attr, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def instrument(llm: LLM, timer: PhaseTimer) -> None:
    core = llm.engine_core
    runner = core.executor.model_runner
    kernel_owner = runner.attn_backend
    timer.wrap(llm, "step", "step")
    timer.wrap(core, "step", "engine core step")
    timer.wrap(core.scheduler, "schedule", "scheduler.schedule")
    timer.wrap(core.scheduler, "update_from_output", "scheduler.update_from_output")
    timer.wrap(runner, "execute_model", "runner.execute_model (input prep + forward)")
    timer.wrap(runner, "forward_fn", "model forward")
    timer.wrap(runner, "compute_logits", "logits")
    timer.wrap(runner, "sample_tokens", "runner.sample_tokens (logits + sampler)")
    if hasattr(kernel_owner, "kernel"):  # the native decode kernel (CpuBackend)
        timer.wrap(kernel_owner, "kernel", "attention kernel")


def start_decoding(llm: LLM, batch: int, prompt_len: int, steps: int) -> None:
    rng = np.random.default_rng(batch)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for _ in range(batch):
        ids = rng.integers(100, llm.engine_core.vocab_size - 100, size=prompt_len).tolist()
        llm.add_request({"prompt_token_ids": ids}, params)
    scheduler = llm.engine_core.scheduler
    # Prefill (in several steps where the prompts exceed one step's token budget), then a few
    # decode steps: the timed steps are pure decodes.
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                   for r in scheduler.running):
        llm.step()
    for _ in range(3):
        llm.step()


def prefill_seconds(llm: LLM, batch: int, prompt_len: int, runs: int) -> list[float]:
    """Process CPU seconds of each of ``runs`` prefills of ``batch`` random prompts."""
    rng = np.random.default_rng(batch)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    vocab = llm.engine_core.vocab_size
    seconds = []
    for run in range(runs + 1):  # run 0 warms up
        prompts = [{"prompt_token_ids": rng.integers(100, vocab - 100, size=prompt_len).tolist()}
                   for _ in range(batch)]
        start = time.process_time()
        llm.generate(prompts, params, use_tqdm=False)
        if run:
            seconds.append(round(time.process_time() - start, 3))
    return seconds


def timed_phases(llm: LLM, timer: PhaseTimer, steps: int) -> dict[str, float]:
    timer.reset()
    cpu_start = time.process_time()
    for _ in range(steps):
        llm.step()
    per_step = {k: v / steps * 1e3 for k, v in timer.seconds.items()}
    per_step["process CPU time"] = (time.process_time() - cpu_start) / steps * 1e3
    outside = per_step["step"] - per_step["model forward"]
    per_step["host outside the forward"] = outside
    return {k: round(v, 3) for k, v in per_step.items()}


def profiled_ops(llm: LLM, steps: int, top: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            llm.step()
    events = prof.events()
    top_level = [e for e in events if e.cpu_parent is None and e.name.startswith("aten::")]
    all_aten = [e for e in events if e.name.startswith("aten::")]
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in top_level:
        by_name[e.name][0] += 1
        by_name[e.name][1] += e.cpu_time_total
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "top_level_ops_per_step": len(top_level) / steps,
        "aten_calls_per_step (nested included)": len(all_aten) / steps,
        "top_level_op_ms_per_step": sum(e.cpu_time_total for e in top_level) / steps / 1e3,
        "ops": {
            name: {"calls_per_step": n / steps, "ms_per_step": round(us / steps / 1e3, 3)}
            for name, (n, us) in ranked
        },
    }


def main() -> None:
    args = parse_args()
    if args.linears:
        compare_linears()
        return
    # Room for every request's tokens at once (the default model in fp32 holds ~46 KB of keys
    # and values a token): a smaller cache would leave requests waiting or preempted, and the
    # timed steps would not be the batch's pure decodes. For the same reason the engine takes
    # the whole batch at once (the default caps it at 256 requests).
    profile_steps = args.steps if args.profile_steps is None else args.profile_steps
    steps = args.steps + profile_steps
    tokens = args.prompt_len + steps + 16
    kv_bytes = max(1 << 30, args.batch * max(16 << 20, tokens * (64 << 10)))
    llm = LLM(dtype=args.dtype, kv_cache_memory=kv_bytes, one_token_step=args.one_token_step,
              max_num_seqs=max(args.batch, SchedulerConfig.max_num_seqs))
    if args.prefills:
        seconds = prefill_seconds(llm, args.batch, args.prompt_len, args.prefills)
        print(json.dumps({"batch": args.batch, "dtype": str(llm.config.model.dtype),
                          "prefill_process_cpu_s": seconds}))
        return
    forward = type(llm.engine_core.executor.model_runner.forward_fn).__name__
    timer = PhaseTimer()
    instrument(llm, timer)
    start_decoding(llm, args.batch, args.prompt_len, steps)
    figures: dict[str, Any] = {
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "dtype": str(llm.config.model.dtype),
        "one_token_step": args.one_token_step,
        "forward": forward,
        "threads": torch.get_num_threads(),
        "phases_ms_per_step": timed_phases(llm, timer, args.steps),
    }
    if profile_steps:
        figures["torch_ops"] = profiled_ops(llm, profile_steps, args.top)
    figures["threads_after"] = torch.get_num_threads()  # the engine's choice, as it ran
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
