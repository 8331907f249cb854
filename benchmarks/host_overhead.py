"""Host (Python) time of one engine decode step, split by phase, on the CPU.

The model is a tiny random Llama (2 layers, hidden 64) so its forward costs next to nothing; what
is left of a step is the host work the GPU would wait for: scheduling, applying the plan and
preparing the inputs, launching the sampler, turning its result into lists, appending tokens,
and the output processor. Each phase is timed with ``time.perf_counter`` by wrapping the
engine's own objects (nothing in the engine changes):

  schedule   Scheduler.schedule
  prep       ModelRunner.execute_model minus the forward (plan, batch order, inputs, metadata)
  forward    the model's forward (on a GPU: one CUDA-graph replay)
  sample     ModelRunner.sample_tokens_async minus logits and sampler (row selection, the
             sampled-token write-back, starting the copy to the host)
  logits+sampler  compute_logits and the Sampler call (on this CPU mostly real compute over
             the [batch, vocab] logits; on a GPU, kernel launches)
  output     AsyncOutput.get_output (the wait, then the tokens as Python lists)
  update     Scheduler.update_from_output
  process    OutputProcessor.process_outputs
  other      the rest of the step (engine loop glue)

Each phase's figure is its median over the decode steps of a run (the prefill step and the
last step are left out); ``total`` is the sum of the phase medians and ``host`` the sum without
forward and logits+sampler. Medians of phases, not of whole steps: on a shared CPU another
process takes the core for a few milliseconds now and then, in whichever phase runs, and a
median per phase leaves those out. (Python's garbage collector pauses the same way; it is the
engine's own cost, but it depends on the whole process's heap, not on the step.)

The vocabulary is 512 by default: with Llama-3's 128256 the CPU spends 2 to 80 ms per step on
the [batch, vocab] logits (real compute here, a few kernels on a GPU), and those tens of
megabytes flush the CPU caches, so every host phase after them runs cold and looks slower than
it is on a GPU host. ``--vocab-size 128256`` measures that setting all the same.

    python benchmarks/host_overhead.py                  # batch 1, 64, 256; sync and async
    python benchmarks/host_overhead.py --batch-sizes 1 64 --scheduling async --repeat 3
    python benchmarks/host_overhead.py --vocab-size 128256 --steps 16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

PHASES = ("schedule", "prep", "forward", "sample", "logits+sampler", "output", "update",
          "process", "other")
DEVICE_PHASES = ("forward", "logits+sampler")
PROMPT_LEN = 64


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--steps", type=int, default=24, help="decode steps per request")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--scheduling", choices=["sync", "async", "both"], default="both")
    p.add_argument("--model-dir", default="/tmp/pagedserve_host_overhead")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs per batch size; each phase reports its best run (a shared CPU)")
    return p.parse_args()


def tiny_checkpoint(root: str, vocab_size: int) -> Path:
    """A random 2-layer, hidden-64 Llama saved once per vocabulary size."""
    path = Path(root) / f"llama-v{vocab_size}"
    if not (path / "config.json").exists():
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=1024)
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(path)
    return path


class PhaseTimer:
    """Accumulates the time of each phase within the current step; ``end_step`` files it."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[phase] += time.perf_counter() - start

        return timed

    def end_step(self) -> None:
        self.steps.append(dict(self.current))
        self.current = defaultdict(float)


class _TimedSampler:
    """Stands in for the runner's Sampler: times its call, forwards everything else."""

    def __init__(self, sampler: Any, timer: PhaseTimer) -> None:
        self._sampler = sampler
        self._call = timer.wrap("logits+sampler", sampler.__call__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sampler, name)


def instrument(llm: Any, timer: PhaseTimer) -> None:
    """Wrap the engine's phases in ``timer`` (instance attributes only)."""
    core = llm.engine_core
    runner = core.model_runner
    scheduler = core.scheduler
    scheduler.schedule = timer.wrap("schedule", scheduler.schedule)
    scheduler.update_from_output = timer.wrap("update", scheduler.update_from_output)
    runner.execute_model = timer.wrap("execute", runner.execute_model)
    runner.forward_fn = timer.wrap("forward", runner.forward_fn)
    runner.model.compute_logits = timer.wrap("logits+sampler", runner.model.compute_logits)
    runner.sampler = _TimedSampler(runner.sampler, timer)
    sample_tokens_async = timer.wrap("sample_tokens", runner.sample_tokens_async)

    def sample_and_time_output() -> Any:
        pending = sample_tokens_async()
        pending.get_output = timer.wrap("output", pending.get_output)
        return pending

    runner.sample_tokens_async = sample_and_time_output
    core.step = timer.wrap("step", core.step)
    process_outputs = timer.wrap("process", llm.output_processor.process_outputs)

    def process_and_end_step(outputs: Any) -> Any:
        result = process_outputs(outputs)  # the last phase of a step (LLM._step's order)
        timer.end_step()
        return result

    llm.output_processor.process_outputs = process_and_end_step


def split_phases(step: dict[str, float]) -> dict[str, float]:
    """Raw wrapper times -> the disjoint phases of the module docstring."""
    get = step.get
    phases = {
        "schedule": get("schedule", 0.0),
        "prep": get("execute", 0.0) - get("forward", 0.0),
        "forward": get("forward", 0.0),
        "sample": get("sample_tokens", 0.0) - get("logits+sampler", 0.0),
        "logits+sampler": get("logits+sampler", 0.0),
        "output": get("output", 0.0),
        "update": get("update", 0.0),
        "process": get("process", 0.0),
    }
    phases["other"] = get("step", 0.0) + phases["process"] - sum(phases.values())
    return phases


def measure(model_dir: Path, batch_size: int, steps: int, async_scheduling: bool,
            vocab_size: int) -> dict[str, float]:
    """Median phase times (seconds) over the decode steps of one run at ``batch_size``."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="float32",
              max_num_seqs=max(batch_size, 1), enforce_eager=True,
              async_scheduling=async_scheduling, max_model_len=1024)
    rng = np.random.default_rng(batch_size)
    warmup = rng.integers(10, vocab_size, size=(batch_size, PROMPT_LEN)).tolist()
    prompts = rng.integers(10, vocab_size, size=(batch_size, PROMPT_LEN)).tolist()
    torch.set_num_threads(1)  # after the engine's own CPU thread policy
    timer = PhaseTimer()
    instrument(llm, timer)
    llm.generate(warmup, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0),
                 use_tqdm=False)
    timer.steps.clear()
    params = SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0.0)
    llm.generate(prompts, params, use_tqdm=False)
    decode_steps = [split_phases(s) for s in timer.steps[1:-1]]  # no prefill, no last step
    return {p: statistics.median(s[p] for s in decode_steps) for p in PHASES}


def best_of(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each phase's smallest median over the runs (another process slowed the others), and
    their sums ``total`` and ``host``."""
    best = {p: min(run[p] for run in runs) for p in PHASES}
    best["total"] = sum(best[p] for p in PHASES)
    best["host"] = best["total"] - sum(best[p] for p in DEVICE_PHASES)
    return best


def print_table(label: str, rows: dict[int, dict[str, float]]) -> None:
    columns = ("total", "host") + PHASES
    print(f"\n{label}: median ms per decode step")
    print(f"{'batch':>6} " + " ".join(f"{c:>14}" for c in columns))
    for batch_size, phases in rows.items():
        print(f"{batch_size:>6} " + " ".join(f"{phases[c] * 1e3:>14.3f}" for c in columns))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    model_dir = tiny_checkpoint(args.model_dir, args.vocab_size)
    modes = {"sync": [False], "async": [True], "both": [False, True]}[args.scheduling]
    for async_scheduling in modes:
        rows = {}
        for b in args.batch_sizes:
            runs = [measure(model_dir, b, args.steps, async_scheduling, args.vocab_size)
                    for _ in range(args.repeat)]
            rows[b] = best_of(runs)
        label = "async scheduling" if async_scheduling else "sync scheduling"
        print_table(f"{label}, vocab {args.vocab_size}", rows)


if __name__ == "__main__":
    main()
