"""Where a step's time goes on the GPU: kernel categories, GPU busy time and host gaps.

``python benchmarks/gpu_profile.py --out DIR`` starts the Llama-3-8B shape (dummy bf16 weights)
once, then for each scenario (decode at batch 1, 64 and 256, one long prefill, and a sweep of batch sizes) brings the batch
to a steady state, times a run of steps without a profiler (the step time), then profiles the
same number of steps with ``torch.profiler`` (CUDA activity) and splits the kernel time into
categories. ``host gap`` is the part of the wall time during which no kernel ran: the GPU
waited for the host. Results go to DIR/profile.json (and a Chrome trace of the batch-1 run).

The ``prefill`` scenario times a few steps of a full token budget of new prompts each and, as
well as their kernel time, lists the torch ops of one such step by self CPU time (an op that
waits for the GPU, such as ``aten::item``, shows there), the caching allocator's device
allocations, and the calls that made the host wait for the GPU during one step (torch's CUDA
sync debug mode, by the Python line that made them): what to look at when its host gap grows.

Scenarios drive the engine step by step (``LLM.add_request`` / ``LLM.step``), so a step here
is exactly one engine step: schedule, prepare inputs, forward, sample, update. The ``sweep``
is what ``plot_decode.py`` draws.

``--quantization fp8 --kv-cache-dtype fp8`` profile the FP8 engine (engine options as in
``pagedserve generate``); running the script twice, with and without them, into two folders
compares bf16 and FP8 kernel time by category, e.g. ``--scenarios b256,prefill``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import KV_CACHE_DTYPES, CompilationConfig, ModelConfig, choices_of
from pagedserve.entrypoints.bench.gpu_busy import busy_union_us

CONFIGS = Path(__file__).resolve().parent / "model-configs"

# Kernel name -> category, first match wins (names from cuBLAS, Triton, Inductor and NCCL).
CATEGORIES = [
    ("gemv (with norm, rotary + KV write, SiLU, residual)", re.compile(r"_gemv_kernel")),
    ("gemm", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|sm90_|splitK", re.I)),
    ("attention", re.compile(r"paged_attention|split_kv|reduce_splits", re.I)),
    ("rotary + kv_write", re.compile(r"kv_write", re.I)),
    ("SiLU-and-mul", re.compile(r"_silu_and_mul(_fp8)?_kernel")),
    ("add + RMSNorm", re.compile(r"_fused_add_rms_norm_kernel")),
    ("input_prep", re.compile(r"prepare_|combine_sampled|gather_block_tables|slot_mappings")),
    ("sampler", re.compile(r"sampl|gumbel|argmax|topk|top_k|sort|radix|softmax|exponential", re.I)),
    ("communication", re.compile(r"nccl", re.I)),
    ("memcpy/memset", re.compile(r"memcpy|memset|Memcpy|Memset")),
    ("fused elementwise (norm, rope, silu)", re.compile(r"^triton_")),
]


def category(name: str) -> str:
    return next((cat for cat, pattern in CATEGORIES if pattern.search(name)), "other")


def add_requests(llm: LLM, batch: int, prompt_len: int, max_tokens: int, round_: int = 0) -> None:
    """``batch`` prompts of random ids, the same for the same (batch, prompt_len, round_): a
    later round's prompts share no prefix with an earlier one's."""
    rng = np.random.default_rng((batch * 7919 + prompt_len) * 101 + round_)
    vocab = llm.engine_core.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for _ in range(batch):
        ids = rng.integers(100, vocab - 100, size=prompt_len).tolist()
        llm.add_request({"prompt_token_ids": ids}, params)


def run_steps(llm: LLM, n: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        llm.step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def profile_steps(llm: LLM, n: int, trace: Path | None) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    cuda = torch.cuda.is_available()  # a CPU run (a smoke test) records no kernels
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(n):
            llm.step()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    per_cat: dict[str, float] = {}
    per_kernel: dict[str, float] = {}
    intervals = []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = event.time_range.end - event.time_range.start
        intervals.append((event.time_range.start, event.time_range.end))
        per_cat[category(event.name)] = per_cat.get(category(event.name), 0.0) + us
        per_kernel[event.name] = per_kernel.get(event.name, 0.0) + us
    busy = busy_union_us(intervals)
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]
    return {
        "profiled_wall_ms_per_step": wall_us / n / 1e3,
        "gpu_busy_ms_per_step": busy / n / 1e3,
        "host_gap_ms_per_step": (wall_us - busy) / n / 1e3,
        "categories_ms_per_step": {k: round(v / n / 1e3, 4) for k, v in sorted(per_cat.items())},
        "top_kernels_ms_per_step": {k[:90]: round(v / n / 1e3, 4) for k, v in top},
    }


def start_decoding(llm: LLM, batch: int, prompt_len: int, steps: int) -> None:
    """Add ``batch`` requests with room for ``steps`` more steps and run them past prefill."""
    budget = llm.config.scheduler.max_num_batched_tokens
    prefill_steps = -(-batch * prompt_len // budget) + 3
    add_requests(llm, batch, prompt_len, prefill_steps + steps + 8)
    for _ in range(prefill_steps):
        llm.step()


def finish_all(llm: LLM) -> None:
    while llm.has_unfinished_requests():
        llm.step()


def scenario(llm: LLM, name: str, batch: int, prompt_len: int, steps: int, out: Path) -> dict:
    """Bring ``batch`` requests past their prefill, then time and profile ``steps`` steps."""
    start_decoding(llm, batch, prompt_len, 2 * steps)
    step_s = run_steps(llm, steps) / steps
    trace = out / f"trace_{name}.json" if batch == 1 else None
    result = {"batch": batch, "context": prompt_len, "step_ms": step_s * 1e3,
              **profile_steps(llm, steps, trace)}  # fmt: skip
    finish_all(llm)
    print(f"[{name}] " + json.dumps(result), flush=True)
    return result


def batch_sweep(llm: LLM, steps: int) -> dict[str, float]:
    """Decode step time (ms, no profiler) at context 1024 for batch sizes 1..256."""
    sweep = {}
    for batch in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        start_decoding(llm, batch, 1024, steps)
        sweep[str(batch)] = run_steps(llm, steps) / steps * 1e3
        finish_all(llm)
        print(f"[sweep] batch {batch}: {sweep[str(batch)]:.3f} ms per step", flush=True)
    return sweep


PREFILL_TIMED_STEPS = 3


def prefill_scenario(llm: LLM, out: Path) -> dict:
    """Steps of prefill tokens only, each a full token budget of new prompts: one to warm up,
    ``PREFILL_TIMED_STEPS`` timed without a profiler (with the caching allocator's device
    allocations and retries over them), one profiled on the GPU (kernel time, host gap) and one
    on the host (the torch ops by self CPU time: where a host gap comes from)."""
    budget = llm.config.scheduler.max_num_batched_tokens
    rounds = iter(range(1, 100))

    def new_prompts() -> None:
        add_requests(llm, budget // 1024, 1024, 1, next(rounds))

    new_prompts()
    finish_all(llm)  # warm-up
    before = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    wall = []
    for _ in range(PREFILL_TIMED_STEPS):
        new_prompts()
        wall.append(run_steps(llm, 1) * 1e3)
        finish_all(llm)
    after = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    allocator = {k: after.get(k, 0) - before.get(k, 0)
                 for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}
    new_prompts()
    result = {"tokens": budget, "step_ms": wall, "allocator": allocator,
              **profile_steps(llm, 1, None)}  # fmt: skip
    finish_all(llm)
    new_prompts()
    result["host_ops"] = host_ops(llm)
    finish_all(llm)
    new_prompts()
    result["host_syncs"] = host_syncs(llm)
    finish_all(llm)
    print("[prefill] " + json.dumps(result), flush=True)
    return result


_SYNC_DEBUG_NOTICE = "Synchronization debug mode is a prototype feature"
"""torch's warning on turning the mode on: no sync."""


def host_syncs(llm: LLM, top: int = 12) -> dict[str, int]:
    """One step with torch's CUDA sync debug mode on: each call that made the host wait for
    the GPU (``.item()``, a blocking copy to the host, a stream synchronize), as
    ``file:line message`` of the Python line that made it, with its count. Empty when nothing
    in the step blocks the host."""
    import warnings
    from collections import Counter

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            llm.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    lines = Counter(f"{Path(w.filename).name}:{w.lineno} {str(w.message)[:70]}" for w in caught
                    if not str(w.message).startswith(_SYNC_DEBUG_NOTICE))
    return dict(lines.most_common(top))


def host_ops(llm: LLM, top: int = 15) -> dict[str, dict[str, float]]:
    """One step under the CPU profiler: its ``top`` torch ops by self CPU time (ms, calls).
    The profiler's own cost per op inflates these; they rank, they do not time the step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.step()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return {e.key[:90]: {"self_ms": round(e.self_cpu_time_total / 1e3, 3), "calls": e.count}
            for e in ops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--config", default="llama-3-8b.json")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--scenarios", default="b1,b64,b256,prefill,sweep")
    parser.add_argument("--one-token-step", default=CompilationConfig.one_token_step,
                        choices=choices_of(CompilationConfig, "one_token_step"),
                        help="how batch-1 decode steps run (engine option)")
    parser.add_argument("--quantization", default=None,
                        choices=choices_of(ModelConfig, "quantization"),
                        help="weights' quantization (engine option; default: as stored)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="KV cache element type (engine option)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp())
    shutil.copy(CONFIGS / args.config, work / "config.json")
    llm = LLM(model=str(work), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              gpu_memory_utilization=0.85, max_num_seqs=256,
              one_token_step=args.one_token_step, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip
    results: dict[str, Any] = {"config": args.config, "quantization": args.quantization,
                               "kv_cache_dtype": args.kv_cache_dtype}  # fmt: skip
    plans = {"b1": (1, 1024), "b64": (64, 1024), "b256": (256, 1500)}
    for name in args.scenarios.split(","):
        if name == "prefill":
            results[name] = prefill_scenario(llm, out)
        elif name == "sweep":
            results[name] = batch_sweep(llm, args.steps)
        else:
            batch, context = plans[name]
            results[name] = scenario(llm, name, batch, context, args.steps, out)
        (out / "profile.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
