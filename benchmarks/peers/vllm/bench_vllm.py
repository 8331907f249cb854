#!/usr/bin/env python3
"""Offline vLLM 0.25.1 benchmark: dummy weights, random token-id prompts, no tokenizer.

Workloads
  latency1   batch 1,  1024-token prompt: mean ms per decode step
  latency64  batch 64, 1024-token prompts: mean ms per decode step
             step = (t(generate 128 out) - t(generate 1 out)) / 127, after one warm-up
  t1000      1000 prompts x 1000 in / 1000 out, temperature 1.0 (like `vllm bench throughput`)
  t2048      1000 prompts x 2048 in /  128 out, temperature 1.0

The last line printed is one JSON object with all figures (also written to --output-json).

Runs vLLM with load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
gpu_memory_utilization=0.9, max_model_len=4096, seed=0 and otherwise default settings
(V1 engine, torch.compile, CUDA graphs, FLASH_ATTN backend = FlashAttention 3 on Hopper);
--quantization fp8 / --kv-cache-dtype fp8 pass vLLM's options of those names (FP8 weights
quantized at load, an FP8 KV cache).
"""

import os

# Set before vLLM is imported; inherited by the EngineCore process.
# FlashInfer is not installed. With VLLM_USE_FLASHINFER_SAMPLER unset, vLLM 0.25.1 imports
# vllm.v1.attention.backends.flashinfer while building the sampler, and that import fails
# with ModuleNotFoundError. With it set to 0 the sampler uses forward_native, which is the
# same code that forward_cuda runs when no top_k/top_p is set (our case:
# temperature 0, or temperature 1.0 with top_p=1.0).
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

import argparse
import json
import sys
import time

WORKLOADS = {
    # name: (kind, batch/num_prompts, input_len, output_len, temperature)
    "latency1": ("latency", 1, 1024, 128, 0.0),
    "latency64": ("latency", 64, 1024, 128, 0.0),
    "t1000": ("throughput", 1000, 1000, 1000, 1.0),
    "t2048": ("throughput", 1000, 2048, 128, 1.0),
}
VOCAB_HI = 128000  # random ids in [0, 128000)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="folder that holds a config.json (weights are dummy)")
    p.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    p.add_argument("--num-prompts", type=int, default=None,
                   help="override the number of prompts of t1000/t2048 (for a quick try)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0, help="vLLM seed and numpy seed for the prompts")
    p.add_argument("--repeats", type=int, default=1,
                   help="latency: number of measured (1-out, 128-out) pairs after the warm-up")
    p.add_argument("--enforce-eager", action="store_true",
                   help="fallback only: disable torch.compile and CUDA graphs (not the default)")
    p.add_argument("--output-json", default=None, help="also write the final JSON here")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="vLLM max_num_seqs (default: vLLM's)")
    p.add_argument("--no-tqdm", action="store_true", help="hide the progress bar")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="vLLM quantization (fp8: FP8 weights quantized at load)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="vLLM kv_cache_dtype")
    p.add_argument("--dry-run", action="store_true",
                   help="parse arguments and build the prompts, do not start vLLM")
    args = p.parse_args(argv)
    if args.num_prompts is not None and args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    cfg = os.path.join(args.model, "config.json")
    if not args.dry_run and not os.path.isfile(cfg):
        p.error(f"{cfg} not found")
    return args


def make_prompts(rng, n, length):
    ids = rng.integers(0, VOCAB_HI, size=(n, length), dtype="int64")
    return [{"prompt_token_ids": row.tolist()} for row in ids]


def count_tokens(outputs):
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    n_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return n_in, n_out


def timed_generate(llm, prompts, sp, use_tqdm):
    # generate() returns only after every output has reached this (frontend) process, so no
    # CUDA sync is needed here; the frontend process never touches the GPU itself.
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=use_tqdm)
    return time.perf_counter() - t0, outs


def run(args):
    import numpy as np

    kind, n, in_len, out_len, temp = WORKLOADS[args.workload]
    if kind == "throughput" and args.num_prompts is not None:
        n = args.num_prompts
    if in_len + out_len > args.max_model_len:
        raise SystemExit(f"input {in_len} + output {out_len} > max_model_len {args.max_model_len}")
    rng = np.random.default_rng(args.seed)
    result = {
        "engine": "vllm", "workload": args.workload, "kind": kind,
        "num_prompts": n, "input_len": in_len, "output_len": out_len, "temperature": temp,
        "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
    }

    if kind == "latency":
        # Distinct prompts for each call, so the prefix cache (on by default) never serves
        # one call from another; t1 and t128 both include a full 1024-token prefill.
        plan = [("warmup", out_len)] + [(f"r{i}", m) for i in range(args.repeats)
                                        for m in (1, out_len)]
        prompt_sets = {f"{tag}_{m}": make_prompts(rng, n, in_len) for tag, m in plan}
    else:
        prompts = make_prompts(rng, n, in_len)

    if args.dry_run:
        result["dry_run"] = True
        print(json.dumps(result), flush=True)
        return result

    import vllm
    from vllm import LLM, SamplingParams

    result["vllm_version"] = vllm.__version__
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}),
    )
    result["startup_s"] = round(time.perf_counter() - t0, 3)
    try:
        sc = llm.llm_engine.vllm_config.scheduler_config
        result["max_num_seqs"] = sc.max_num_seqs
        result["max_num_batched_tokens"] = sc.max_num_batched_tokens
    except Exception as e:
        result["config_err"] = repr(e)
    print(f"[bench] LLM() constructed in {result['startup_s']:.1f} s", flush=True)
    use_tqdm = not args.no_tqdm

    if kind == "latency":
        def sp(m):
            return SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0, detokenize=False)

        tag, m = plan[0]
        # like `vllm bench latency`: no progress bar inside timed latency calls
        dt, outs = timed_generate(llm, prompt_sets[f"{tag}_{m}"], sp(m), False)
        result["warmup_s"] = round(dt, 4)
        steps = []
        t1s, t128s = [], []
        for i in range(args.repeats):
            d1, o1 = timed_generate(llm, prompt_sets[f"r{i}_1"], sp(1), False)
            dN, oN = timed_generate(llm, prompt_sets[f"r{i}_{out_len}"], sp(out_len), False)
            got = count_tokens(oN)[1]
            if got != n * out_len:
                print(f"[bench] WARNING: expected {n * out_len} output tokens, got {got}",
                      flush=True)
            t1s.append(d1)
            t128s.append(dN)
            steps.append((dN - d1) / (out_len - 1) * 1000.0)
            print(f"[bench] repeat {i}: t(1 out)={d1:.4f}s t({out_len} out)={dN:.4f}s "
                  f"-> {steps[-1]:.3f} ms/step", flush=True)
        result.update({
            "batch": n,
            "t_1out_s": [round(x, 5) for x in t1s],
            f"t_{out_len}out_s": [round(x, 5) for x in t128s],
            "decode_ms_per_step": round(sum(steps) / len(steps), 4),
            "decode_ms_per_step_all": [round(x, 4) for x in steps],
            "prefill_plus_first_token_s": round(sum(t1s) / len(t1s), 5),
        })
    else:
        # Same SamplingParams as `vllm bench throughput`.
        params = SamplingParams(n=1, temperature=temp, top_p=1.0, ignore_eos=True,
                                max_tokens=out_len, detokenize=False)
        elapsed, outs = timed_generate(llm, prompts, params, use_tqdm)
        n_in, n_out = count_tokens(outs)
        result.update({
            "wall_s": round(elapsed, 3),
            "prompt_tokens": n_in,
            "output_tokens": n_out,
            "requests_per_s": round(len(outs) / elapsed, 4),
            "output_tokens_per_s": round(n_out / elapsed, 2),
            "total_tokens_per_s": round((n_in + n_out) / elapsed, 2),
        })
        if n_out != n * out_len:
            print(f"[bench] WARNING: expected {n * out_len} output tokens, got {n_out}", flush=True)

    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    # Stop the EngineCore process now (frees the GPU before the next run), then print.
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # best effort; vLLM's own finalizers also do this at exit
        print(f"[bench] engine shutdown: {e!r}", flush=True)
    print(json.dumps(result), flush=True)
    return result


def main(argv=None):
    args = parse_args(argv)
    run(args)
    sys.stdout.flush()


if __name__ == "__main__":  # required: vLLM may start its EngineCore with 'spawn'
    main()
