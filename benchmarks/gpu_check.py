"""The GPU path on one card: correctness of the fast path, then the first figures.

Run on a CUDA machine: ``python benchmarks/gpu_check.py --out DIR``. Each section prints one
line per result and appends it to DIR/gpu_check.json; a failing section is reported and the
next one still runs.

1. tiny fp32 Llama: greedy tokens of the fast path (compiled pieces, FULL and PIECEWISE graphs,
   Triton attention) equal the CUDA eager run, the CPU torch-reference run and transformers;
   the batch mixes FULL, PIECEWISE and eager (> max capture size) steps.
2. Llama-3-8B shape, dummy bf16 weights: logprobs of the eager and of the graph runs agree
   (vLLM's check_logprobs_close rule); start-up time of both.
3. ``pagedserve bench latency`` at batch 1 and 64 and ``bench throughput`` (1000 x 1024/128).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "benchmarks" / "model-configs"


def log(out: Path, name: str, **values) -> None:  # noqa: ANN003
    print(f"[{name}] " + ", ".join(f"{k}={v}" for k, v in values.items()), flush=True)
    with open(out / "gpu_check.json", "a") as f:
        f.write(json.dumps({"section": name, **values}) + "\n")


def section(out: Path, name: str):  # noqa: ANN201
    def wrap(fn):  # noqa: ANN001, ANN202
        def run(*args):  # noqa: ANN002, ANN202
            start = time.perf_counter()
            try:
                fn(*args)
            except Exception as e:  # a failing section must not stop the others
                traceback.print_exc()
                log(out, name, error=f"{type(e).__name__}: {e}"[:500])
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            print(f"[{name}] took {time.perf_counter() - start:.1f} s", flush=True)

        return run

    return wrap


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PIECE_COMPILER = ["inductor"]  # becomes "eager" if Inductor fails on this machine


def graph_sizes(llm) -> dict:  # noqa: ANN001
    compiled = llm.engine_core.model_runner.compiled_forward
    return {} if compiled is None else compiled.captured_sizes()


def tiny_llama(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                      initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(cfg).eval().save_pretrained(path)


def greedy(llm, prompts, n):  # noqa: ANN001, ANN201
    from pagedserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def mixed_prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]


def run_tiny(out: Path, work: Path) -> None:
    from transformers import LlamaForCausalLM

    from pagedserve import LLM

    model_dir = work / "tiny"
    tiny_llama(model_dir)
    # 700 tokens > max capture size (512): an eager step; short prompts mix PIECEWISE; decodes FULL.
    prompts = mixed_prompts(512, [700, 5, 37, 130, 260, 3, 64, 400])
    common = dict(model=str(model_dir), dtype="float32", skip_tokenizer_init=True,
                  max_num_batched_tokens=1024, max_num_seqs=16, gpu_memory_utilization=0.3)
    try:
        fast = LLM(**common, piece_compiler=PIECE_COMPILER[0])
    except Exception as e:  # fall back to uncompiled pieces, still captured as graphs
        traceback.print_exc()
        log(out, "tiny.inductor_failed", error=f"{type(e).__name__}: {e}"[:300])
        PIECE_COMPILER[0] = "eager"
        fast = LLM(**common, piece_compiler="eager")
    runner = fast.engine_core.model_runner
    log(out, "tiny.captured", sizes=graph_sizes(fast),
        piece_compiler=runner.config.compilation.piece_compiler)
    got = greedy(fast, prompts, 24)
    del fast
    torch.cuda.empty_cache()
    eager = greedy(LLM(**common, enforce_eager=True), prompts, 24)
    cpu = greedy(LLM(**{**common, "device": "cpu"}, enforce_eager=True), prompts, 24)
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()
    hf_tokens = []
    for p in prompts:
        ids = torch.tensor([p], device=DEVICE)
        gen = hf.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)
        hf_tokens.append(gen[0, len(p):].tolist())
    log(out, "tiny.greedy_equal",
        fast_vs_cuda_eager=all(
            a.token_ids == b.token_ids for a, b in zip(got, eager, strict=True)),
        fast_vs_cpu_torch_ref=all(
            a.token_ids == b.token_ids for a, b in zip(got, cpu, strict=True)),
        fast_vs_transformers=all(a.token_ids == h for a, h in zip(got, hf_tokens, strict=True)))


def logprobs_close(a, b) -> tuple[bool, int]:  # noqa: ANN001
    """vLLM's check_logprobs_close: equal tokens until the first divergence, where each side's
    token must be in the other's top-5. Returns (ok, index of first divergence or -1)."""
    for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids, strict=False)):
        if ta != tb:
            return tb in a.logprobs[i] and ta in b.logprobs[i], i
    return True, -1


SHAPE = "llama-3-8b.json"
BENCH_TIMEOUT_S = 240


def llama8b_dir(work: Path) -> Path:
    d = work / SHAPE.removesuffix(".json")
    d.mkdir(exist_ok=True)
    shutil.copy(CONFIGS / SHAPE, d / "config.json")
    return d


def run_8b_logprobs(out: Path, work: Path) -> None:
    from pagedserve import LLM

    d = llama8b_dir(work)
    prompts = mixed_prompts(32000, [600, 17, 130, 300, 1, 45, 1000, 250])
    common = dict(model=str(d), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                  max_num_seqs=64, gpu_memory_utilization=0.4, max_model_len=4096)
    start = time.perf_counter()
    eager_llm = LLM(**common, enforce_eager=True)
    log(out, "8b.startup_eager_s", seconds=round(time.perf_counter() - start, 1))
    eager = greedy(eager_llm, prompts, 32)
    del eager_llm
    torch.cuda.empty_cache()
    start = time.perf_counter()
    fast_llm = LLM(**common, piece_compiler=PIECE_COMPILER[0])
    log(out, "8b.startup_graphs_s", seconds=round(time.perf_counter() - start, 1),
        captured=graph_sizes(fast_llm))
    fast = greedy(fast_llm, prompts, 32)
    checks = [logprobs_close(a, b) for a, b in zip(fast, eager, strict=True)]
    log(out, "8b.logprobs_close", all_ok=all(ok for ok, _ in checks),
        first_divergence=[i for _, i in checks])
    del fast_llm
    torch.cuda.empty_cache()


def run_bench(out: Path, work: Path, argv: list[str], name: str) -> None:
    d = llama8b_dir(work)
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", *argv, "--model", str(d),
           "--load-format", "dummy", "--dtype", "bfloat16", "--output-json", str(out / f"{name}.json"),
           "--piece-compiler", PIECE_COMPILER[0], "--gpu-memory-utilization", "0.6"]
    log(out, f"{name}.command", cmd="pagedserve " + " ".join(cmd[3:]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    print(proc.stdout[-3000:], proc.stderr[-3000:], flush=True)
    log(out, f"{name}.result", rc=proc.returncode, tail=proc.stdout.strip().splitlines()[-1:] )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--sections", default="tiny,8b,latency,throughput")
    parser.add_argument("--shape", default=SHAPE, help="config file in benchmarks/model-configs")
    parser.add_argument("--num-prompts", default="1000")
    args = parser.parse_args()
    globals()["SHAPE"] = args.shape
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp())
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    log(out, "device", card=name, torch=torch.__version__)
    wanted = args.sections.split(",")
    if "tiny" in wanted:
        section(out, "tiny")(run_tiny)(out, work)
    if "8b" in wanted:
        section(out, "8b")(run_8b_logprobs)(out, work)
    if "latency" in wanted:
        for b in (1, 64):
            section(out, f"latency_b{b}")(run_bench)(
                out, work, ["latency", "--batch-size", str(b), "--input-len", "1024",
                            "--output-len", "128", "--temperature", "0"], f"latency_b{b}")
    if "throughput" in wanted:
        section(out, "throughput")(run_bench)(
            out, work, ["throughput", "--num-prompts", args.num_prompts, "--input-len", "1024",
                        "--output-len", "128", "--temperature", "0"], "throughput")


if __name__ == "__main__":
    main()
