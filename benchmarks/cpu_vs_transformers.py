"""Offline throughput on the CPU: pagedserve's ``LLM.generate`` against transformers' batched
``generate``, side by side in one process, on the default model (SmolLM2-135M-Instruct, GGUF).

Both read the same GGUF file in the same dtype, get the same token-id prompts (all of one
length, so transformers needs no padding), decode greedily and ignore EOS, so both produce
exactly ``num_prompts * output_len`` tokens. Each side runs a small warm-up first; load time
is not counted.

    python benchmarks/cpu_vs_transformers.py            # 64 prompts x 128 in, 128 out
    python benchmarks/cpu_vs_transformers.py --num-prompts 8 --output-len 16   # a quick look

Both sides run with the same torch thread count (``--threads``; default: the engine's CPU
policy, the cores other processes leave idle). The load average is printed before and after:
on a shared machine, compare runs made under similar load.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np
import torch

from pagedserve.model.resolve import default_model_file
from pagedserve.platform import cpu_thread_count, resolve_device, resolve_dtype, usable_cpu_cores

KV_CACHE_BYTES = 1 << 30
"""Our KV budget: room for every request at once (64 x 256 tokens need ~380 MB in bf16)."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 (default: auto)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads for both sides (0: the idle cores, as the engine's CPU policy)",
    )
    return p.parse_args()


def make_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random ordinary (non-special) token ids."""
    rng = np.random.default_rng(seed)
    return rng.integers(100, vocab_size, size=(num_prompts, input_len)).tolist()


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    start = time.perf_counter()
    num_tokens = fn()
    return time.perf_counter() - start, num_tokens


def run_pagedserve(llm, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    from pagedserve.sampling_params import SamplingParams

    def generate(batch: list[list[int]], max_tokens: int) -> int:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    generate(prompts[:2], 4)  # warm-up
    return timed(lambda: generate(prompts, output_len))


def run_transformers(
    prompts: list[list[int]], output_len: int, dtype: torch.dtype
) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    gguf = default_model_file()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=dtype
    ).eval()

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

    generate(prompts[:2], 4)  # warm-up
    return timed(lambda: generate(prompts, output_len))


def load_average() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    args = parse_args()
    load_before = load_average()
    threads = args.threads or cpu_thread_count(usable_cpu_cores(), os.getloadavg()[0])
    dtype = resolve_dtype(args.dtype, resolve_device("cpu"))
    dtype_name = str(dtype).removeprefix("torch.")
    from pagedserve.entrypoints.llm import LLM

    torch.set_num_threads(threads)
    llm = LLM(dtype=dtype_name, kv_cache_memory=KV_CACHE_BYTES)
    torch.set_num_threads(threads)  # again: the engine's start-up may choose its own
    prompts = make_prompts(args.num_prompts, args.input_len, llm.engine_core.vocab_size, args.seed)
    print(
        f"{args.num_prompts} prompts x {args.input_len} tokens -> {args.output_len} tokens, "
        f"greedy, EOS ignored, {dtype_name}, {threads} threads; load average {load_before}"
    )

    ours_s, ours_tokens = run_pagedserve(llm, prompts, args.output_len)
    del llm  # free our weights and KV cache before transformers loads its copy
    hf_s, hf_tokens = run_transformers(prompts, args.output_len, dtype)
    expected = args.num_prompts * args.output_len
    assert ours_tokens == hf_tokens == expected, (ours_tokens, hf_tokens, expected)

    ours_tps, hf_tps = ours_tokens / ours_s, hf_tokens / hf_s
    print(f"pagedserve   : {ours_s:7.1f} s  {ours_tps:8.1f} output tok/s")
    print(f"transformers : {hf_s:7.1f} s  {hf_tps:8.1f} output tok/s")
    print(f"ratio        : {ours_tps / hf_tps:.2f}x")
    print(f"load average : {load_average()} (1/5/15 min, at the end)")


if __name__ == "__main__":
    main()
