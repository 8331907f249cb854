"""The headline GPU figures in one process (one engine start for the 8B workloads).

``python benchmarks/suite.py --out DIR [--sections tiny,b1,b64,t1024,t2048,warm,qwen3,t1000]``
runs, on a CUDA machine, the project's own bench code (``pagedserve.entrypoints.bench``: the
same functions ``pagedserve bench latency`` and ``pagedserve bench throughput`` call) on the
Llama-3-8B shape with dummy bf16 weights, greedy: ``tiny`` (the fast path's greedy tokens equal
the CPU reference's on a tiny fp32 Llama), ``b1`` / ``b64`` (decode step at batch 1 / 64,
1024-token prompts), ``t1024`` / ``t2048`` / ``t1000`` (1000 prompts of 1024 in / 128 out,
2048 / 128, 1000 / 1000; output tok/s, ratio to the roofline, and on NVIDIA cards the energy
and output tokens per joule), ``warm`` (a warm start-up in a fresh process), ``qwen3`` (the
Qwen3-0.6B shape, 256 requests of 100..1024 in and out: GPU busy). Not in the default
sections: ``fp8`` runs FP8 against bf16 in engines of their own, first, on the whole card
(``fp8_suite.py``); ``structured`` runs ``structured.py``'s three figures on the 8B engine;
``spec`` (speculative decoding: verify and draft step times at k = 1..5, break-even
acceptance, end-to-end speedups at known acceptance, batch 64 with speculation configured;
``spec_decode_bench.py``: run first, its engines each in a process of its own). Each result is
one JSON line in DIR/suite.json; BENCHMARKS.md shows them.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import spec_decode_bench
import structured
import torch

from pagedserve.config import CompilationConfig, choices_of
from pagedserve.entrypoints.bench import latency, throughput
from pagedserve.entrypoints.bench.common import make_llm
from pagedserve.entrypoints.cli import build_parser

CONFIGS = Path(__file__).resolve().parent / "model-configs"
COMMON = ["--load-format", "dummy", "--dtype", "bfloat16", "--temperature", "0"]


def bench_args(argv: list[str]) -> argparse.Namespace:
    parser, _ = build_parser("bench")
    return parser.parse_args(["bench", *argv])


def model_dir(work: Path, config: str) -> str:
    d = work / config.removesuffix(".json")
    d.mkdir(exist_ok=True)
    shutil.copy(CONFIGS / config, d / "config.json")
    return str(d)


class Suite:
    def __init__(self, out: Path) -> None:
        self.out = out

    def log(self, name: str, **values) -> None:  # noqa: ANN003
        print(f"[{name}] " + json.dumps(values, default=str)[:600], flush=True)
        with open(self.out / "suite.json", "a") as f:
            f.write(json.dumps({"section": name, **values}, default=str) + "\n")

    def run(self, name: str, fn, *args) -> object:  # noqa: ANN001
        start = time.perf_counter()
        try:
            result = fn(*args)
            self.log(name, seconds=round(time.perf_counter() - start, 1), result=result)
            return result
        except Exception as e:  # one failing workload must not stop the others
            traceback.print_exc()
            self.log(name, error=f"{type(e).__name__}: {e}"[:400])
            return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--sections", default="tiny,b1,b64,t1024,t2048,warm,qwen3,t1000")
    parser.add_argument("--one-token-step", default=CompilationConfig.one_token_step,
                        choices=choices_of(CompilationConfig, "one_token_step"),
                        help="how the 8B engine runs batch-1 decode steps (engine option)")
    parser.add_argument("--budget-step-graph", action="store_true",
                        help="the 8B engine also captures its token budget's PIECEWISE graph")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suite, work, wanted = Suite(out), Path(tempfile.mkdtemp()), args.sections.split(",")
    if "fp8" in wanted:  # before any engine of this process holds the card's memory
        from fp8_suite import ENGINES, MAX_NUM_SEQS, run_all

        suite.run("fp8", run_all, suite, out, list(ENGINES), MAX_NUM_SEQS)
    if "spec" in wanted:  # engines in processes of their own, while this one holds none
        suite.run("spec", spec_decode_bench.run_all, suite.log, work)
    llama = ["--model", model_dir(work, "llama-3-8b.json"), *COMMON]
    engine = [*llama, "--gpu-memory-utilization", "0.6", "--max-num-seqs", "256",
              "--one-token-step", args.one_token_step,
              *(["--budget-step-graph"] if args.budget_step_graph else [])]

    if "tiny" in wanted:
        suite.run("tiny.async_greedy_equal", tiny_check, work)
    llm = None
    if {"b1", "b64", "t1024", "t2048", "t1000", "structured"} & set(wanted):
        start = time.perf_counter()
        llm = suite.run("8b.start_cold", make_llm, bench_args(["latency", *engine]))
        suite.log("8b.start_cold_s", seconds=round(time.perf_counter() - start, 1))
    workloads = {
        "b1": (latency, ["latency", *engine, "--batch-size", "1", "--num-iters", "2"]),
        "b64": (latency, ["latency", *engine, "--batch-size", "64", "--num-iters", "2"]),
        "t1024": (throughput, ["throughput", *engine, "--num-prompts", "1000",
                               "--input-len", "1024", "--output-len", "128"]),
        "t2048": (throughput, ["throughput", *engine, "--num-prompts", "1000",
                               "--input-len", "2048", "--output-len", "128"]),
        "t1000": (throughput, ["throughput", *engine, "--num-prompts", "1000",
                               "--input-len", "1000", "--output-len", "1000"]),
    }
    for key, (module, argv) in workloads.items():
        if key in wanted and key != "t1000" and llm is not None:
            suite.run(f"8b.{key}", module.run, llm, bench_args(argv))
    if "structured" in wanted and llm is not None:  # benchmarks/structured.py
        suite.run("8b.structured", structured.run, llm, Path(llama[1]))
    gc.collect()

    if "warm" in wanted:  # a fresh process: the Inductor cache on disk is warm now
        code = ("import sys, time; t = time.perf_counter(); "
                "from pagedserve.entrypoints.bench.common import make_llm; "
                "from pagedserve.entrypoints.cli import build_parser; "
                "p, _ = build_parser('bench'); make_llm(p.parse_args(sys.argv[1:])); "
                "print('READY', time.perf_counter() - t)")
        argv = ["bench", "latency", *llama, "--gpu-memory-utilization", "0.3"]
        suite.run("8b.start_warm", lambda: subprocess.run(
            [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=200
        ).stdout.strip().splitlines()[-1:])
    if "qwen3" in wanted:
        qwen = ["--model", model_dir(work, "qwen3-0.6b.json"), *COMMON,
                "--gpu-memory-utilization", "0.25", "--max-num-seqs", "256"]
        small = suite.run("qwen3.start", make_llm, bench_args(["throughput", *qwen]))
        if small is not None:
            suite.run("qwen3.t256", throughput.run, small, bench_args(
                ["throughput", *qwen, "--num-prompts", "256", "--input-len", "562",
                 "--output-len", "562", "--range-ratio", "0.822"]))
    if "t1000" in wanted and llm is not None:
        module, argv = workloads["t1000"]
        suite.run("8b.t1000", module.run, llm, bench_args(argv))


def tiny_workload(work: Path) -> tuple[list[dict], dict]:
    """A tiny random fp32 Llama saved under ``work``, eight prompts of 3..700 tokens, and the
    engine options both sides of a tiny check share."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                      initializer_range=0.2, bos_token_id=None, eos_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(work / "tiny")
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(10, 512, (n,), generator=g).tolist()}
               for n in [700, 5, 37, 130, 260, 3, 64, 400]]
    common = dict(model=str(work / "tiny"), dtype="float32", skip_tokenizer_init=True,
                  max_num_batched_tokens=1024, max_num_seqs=16, gpu_memory_utilization=0.05)
    return prompts, common


def tiny_check(work: Path) -> dict:
    """Greedy tokens of the fast path with async scheduling (CUDA default) equal the CPU
    torch-reference run's, on a tiny fp32 Llama; the batch mixes FULL, PIECEWISE and eager."""
    from pagedserve import LLM, SamplingParams

    prompts, common = tiny_workload(work)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    fast_llm = LLM(**common)
    fast = [o.outputs[0].token_ids for o in fast_llm.generate(prompts, params, use_tqdm=False)]
    async_on = fast_llm.engine_core.config.scheduler.async_scheduling
    del fast_llm
    cpu_llm = LLM(**common, device="cpu", enforce_eager=True)
    ref = [o.outputs[0].token_ids for o in cpu_llm.generate(prompts, params, use_tqdm=False)]
    return {"async_scheduling": async_on, "equal": fast == ref}


if __name__ == "__main__":
    main()
