"""Offline throughput on the CPU: pagedserve's ``LLM.generate`` against transformers' batched
``generate`` on the default model (SmolLM2-135M-Instruct, GGUF).

Both read the same GGUF file, get the same token-id prompts (all of one length, so
transformers needs no padding), decode greedily and ignore EOS, so both produce exactly
``num_prompts * output_len`` tokens. Each run has a small warm-up first, on other prompts (ours
would otherwise find their blocks in its prefix cache); load time is not counted.

Two comparisons, each printed with its dtypes:
  (a) same dtype  -- both engines in ``--dtype`` (default: what ours picks with ``auto``);
      the engine-vs-engine comparison.
  (b) defaults    -- ours with ``dtype="auto"`` (bf16 on CPUs with native bf16 matmuls),
      transformers with no dtype given (it loads a GGUF in float32): what a user gets running
      both out of the box.

Every run is a fresh process (``spawn``): our engine tunes its process at start-up (torch
threads, glibc malloc), and one run must not inherit another's settings, memory or caches.
``--one-process`` runs them all side by side in this process instead, transformers first.
All runs use the same torch thread count (``--threads``; default: the engine's CPU policy,
the cores other processes leave idle). The load average is printed around each run: on a
shared machine, compare runs made under similar load.

    python benchmarks/cpu_vs_transformers.py            # 64 prompts x 128 in, 128 out
    python benchmarks/cpu_vs_transformers.py --num-prompts 8 --output-len 16   # a quick look
    python benchmarks/cpu_vs_transformers.py --dtype float32 --json out.json
    python benchmarks/cpu_vs_transformers.py --one-process
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import torch

from pagedserve.cpu_threads import threads_beside, usable_cpu_cores
from pagedserve.model.gguf_config import gguf_to_hf_config
from pagedserve.model.resolve import default_model_file
from pagedserve.platform import resolve_device, resolve_dtype

KV_CACHE_BYTES = 1 << 30
"""Our KV budget: room for every request at once (64 x 256 tokens need ~380 MB in bf16)."""
WARMUP_PROMPTS, WARMUP_TOKENS = 2, 4


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    warmup: list[list[int]]
    output_len: int
    threads: int


@dataclass(frozen=True)
class Run:
    engine: str  # "pagedserve" | "transformers"
    dtype: str  # the dtype the model ran in
    seconds: float
    output_tokens: int
    load_before: str
    load_after: str

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--dtype", default="auto", help="comparison (a): auto | float32 | bfloat16 (default: auto)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads for every run (0: the idle cores, as the engine's CPU policy)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument(
        "--one-process",
        action="store_true",
        help="run everything in this process, transformers first (default: a fresh process "
        "per run, so no run inherits another's thread pool, allocator state or caches)",
    )
    return p.parse_args()


def make_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random ordinary (non-special) token ids."""
    rng = np.random.default_rng(seed)
    return rng.integers(100, vocab_size, size=(num_prompts, input_len)).tolist()


def load_average() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def run_pagedserve(dtype: str, work: Workload) -> Run:
    """In a fresh process: load our engine, warm up, time ``LLM.generate``."""
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    torch.set_num_threads(work.threads)
    llm = LLM(dtype=dtype, kv_cache_memory=KV_CACHE_BYTES)
    torch.set_num_threads(work.threads)  # again: the engine's start-up may lower it

    def generate(batch: list[list[int]], max_tokens: int) -> int:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    generate(work.warmup, WARMUP_TOKENS)
    dtype_used = llm.config.model.dtype
    return _timed("pagedserve", dtype_used, lambda: generate(work.prompts, work.output_len))


def run_transformers(dtype: str | None, work: Workload) -> Run:
    """In a fresh process: load the GGUF with transformers (``dtype`` None: its default)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(work.threads)
    gguf = default_model_file()
    kwargs = {} if dtype is None else {"dtype": resolve_dtype(dtype, torch.device("cpu"))}
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, **kwargs)
    model = model.eval()

    def generate(batch: list[list[int]], max_tokens: int) -> int:
        input_ids = torch.tensor(batch)
        config = GenerationConfig(
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=model.generation_config.eos_token_id,
        )
        with torch.inference_mode():
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
            )
        return int(out[:, input_ids.shape[1] :].numel())

    generate(work.warmup, WARMUP_TOKENS)
    dtype_used = dtype_name(model.dtype)
    return _timed("transformers", dtype_used, lambda: generate(work.prompts, work.output_len))


def _timed(engine: str, dtype: str, generate: Callable[[], int]) -> Run:
    load_before = load_average()
    start = time.perf_counter()
    num_tokens = generate()
    seconds = time.perf_counter() - start
    return Run(engine, dtype, seconds, num_tokens, load_before, load_average())


def in_fresh_process(fn: Callable[..., Run], *args: object) -> Run:
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def in_this_process(fn: Callable[..., Run], *args: object) -> Run:
    return fn(*args)


def ratio_line(label: str, ours: Run, theirs: Run) -> str:
    ratio = ours.tokens_per_s / theirs.tokens_per_s
    return (
        f"{label}: pagedserve {ours.dtype} {ours.tokens_per_s:.1f} tok/s vs transformers "
        f"{theirs.dtype} {theirs.tokens_per_s:.1f} tok/s = {ratio:.2f}x"
    )


def main() -> None:
    args = parse_args()
    cpu = resolve_device("cpu")
    same = dtype_name(resolve_dtype(args.dtype, cpu))  # comparison (a)
    ours_default = dtype_name(resolve_dtype("auto", cpu))  # comparison (b), our side
    threads = args.threads or threads_beside(usable_cpu_cores(), os.getloadavg()[0])
    # Fixed for every run (spawned processes inherit it): the engine leaves a count set by
    # OMP_NUM_THREADS alone, where it would otherwise follow the machine's load.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    vocab_size = gguf_to_hf_config(default_model_file()).vocab_size
    work = Workload(
        make_prompts(args.num_prompts, args.input_len, vocab_size, args.seed),
        make_prompts(WARMUP_PROMPTS, args.input_len, vocab_size, args.seed + 1),
        args.output_len,
        threads,
    )
    print(
        f"{args.num_prompts} prompts x {args.input_len} tokens -> {args.output_len} tokens, "
        f"greedy, EOS ignored, {threads} threads; load average {load_average()}"
    )
    # key -> (runner, dtype argument). A run both comparisons need happens once: transformers'
    # default run comes first and also stands for its dtype. Transformers runs before ours: in
    # one process, our engine's start-up tuning (threads, malloc) must not help or hurt it.
    plan = {
        ("transformers", "default"): (run_transformers, None),
        ("transformers", same): (run_transformers, same),
        ("pagedserve", same): (run_pagedserve, same),
        ("pagedserve", ours_default): (run_pagedserve, "auto"),
    }
    execute = in_this_process if args.one_process else in_fresh_process
    runs: dict[tuple[str, str], Run] = {}
    for key, (fn, dtype) in plan.items():
        if key in runs:
            continue
        run = execute(fn, dtype, work)
        print(
            f"  {run.engine:12s} {run.dtype:8s}: {run.seconds:7.1f} s {run.tokens_per_s:8.1f} "
            f"output tok/s  (load {run.load_before} -> {run.load_after})",
            flush=True,
        )
        runs[key] = run
        runs[(run.engine, run.dtype)] = run  # transformers' default is also its dtype
    expected = args.num_prompts * args.output_len
    assert all(r.output_tokens == expected for r in runs.values()), (runs, expected)

    a = (runs[("pagedserve", same)], runs[("transformers", same)])
    b = (runs[("pagedserve", ours_default)], runs[("transformers", "default")])
    print(ratio_line("(a) same dtype            ", *a))
    print(ratio_line("(b) each side's default   ", *b))
    if args.json:
        write_json(args, threads, a, b)


def write_json(
    args: argparse.Namespace, threads: int, a: tuple[Run, Run], b: tuple[Run, Run]
) -> None:
    import transformers

    def side(run: Run) -> dict:
        return {**asdict(run), "tokens_per_s": run.tokens_per_s}

    def comparison(pair: tuple[Run, Run]) -> dict:
        ours, theirs = pair
        return {
            "pagedserve": side(ours),
            "transformers": side(theirs),
            "ratio": ours.tokens_per_s / theirs.tokens_per_s,
        }

    figures = {
        "workload": {
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "greedy": True,
            "ignore_eos": True,
        },
        "threads": threads,
        "machine": {
            "cpu": cpu_model_name(),
            "cores": usable_cpu_cores(),
            "arch": platform.machine(),
        },
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "same_dtype": comparison(a),
        "defaults": comparison(b),
    }
    args.json.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"figures written to {args.json}")


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    main()
