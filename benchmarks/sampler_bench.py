"""Sampler micro-benchmark on one CUDA device: the torch reference path against the Triton path.

    python benchmarks/sampler_bench.py --out DIR

For 1, 64 and 256 rows of bf16 logits over the Llama-3 vocabulary (128256) and each sampling
mode (greedy, temperature, top-k 50, top-p 0.9, top-k + top-p, min-p), it times one Sampler call
(no logit_bias, penalties or logprobs, so the call is the token sampler) with CUDA events after a
warm-up, checks that both paths sample the same tokens and, for the truncating modes, keep the
same tokens; then prints a table and writes DIR/sampler_bench.json.

Logits are N(0, scale^2). Scale 4 is peaked like a chat model's next-token distribution (at
temperature 0.8, top-p 0.9 keeps ~100 tokens); scale 1.5 is flat (top-p 0.9 keeps tens of
thousands: the worst case of the truncation search).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedserve.kernels.sampling_common import kept_mask  # noqa: E402
from pagedserve.kernels.sampling_truncation import truncation_cuts  # noqa: E402
from pagedserve.sample import Sampler, SamplingStates  # noqa: E402
from pagedserve.sample.token_sampler import TokenSampler, TorchTokenSampler, truncate  # noqa: E402
from pagedserve.sample.triton_token_sampler import TritonTokenSampler, slot_params  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402

DEVICE = torch.device("cuda")
MODES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.8),
    "top_k=50": SamplingParams(temperature=0.8, top_k=50),
    "top_p=0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "top_k=50,top_p=0.9": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "min_p=0.1": SamplingParams(temperature=0.8, min_p=0.1),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for sampler_bench.json")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--scales", type=float, nargs="+", default=[4.0, 1.5])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    return parser.parse_args()


def make_sampler(
    token_sampler: TokenSampler, rows: int, vocab: int, params: SamplingParams
) -> Sampler:
    """Every slot holds an unseeded request: the engine seed gives both paths the same seeds."""
    states = SamplingStates(rows, vocab, DEVICE, seed=0)
    sampler = Sampler(states)
    sampler.token_sampler = token_sampler
    for slot in range(rows):
        states.add_request(slot, params, 0)
        sampler.add_request(slot, params, [1], [])
    states.staging.copy_to_device()
    return sampler


def time_calls(fn, warmup: int, iters: int) -> list[float]:  # noqa: ANN001
    """Milliseconds per call, each between its own pair of CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def kept_set_mismatches(sampler: Sampler, logits: torch.Tensor, idx: torch.Tensor,
                        idx_np: np.ndarray) -> int:
    """Rows whose kept tokens differ between the truncation kernel and the torch reference."""
    states = sampler.states
    cuts = truncation_cuts(logits, idx, slot_params(states))
    got = kept_mask(logits.float() / states.temperature[idx].unsqueeze(1), cuts)
    want = truncate(logits.to(torch.float32, copy=True), states, idx, idx_np) > float("-inf")
    return int((got != want).any(dim=1).sum())


def run_case(rows: int, mode: str, scale: float, args: argparse.Namespace) -> dict:
    params = MODES[mode]
    gen = torch.Generator(device=DEVICE).manual_seed(rows)
    logits = torch.randn(rows, args.vocab, generator=gen, device=DEVICE) * scale
    logits = logits.to(torch.bfloat16)  # [rows, V], the model's dtype
    idx_np = np.arange(rows, dtype=np.int32)
    idx = torch.from_numpy(idx_np).to(DEVICE)
    result: dict = {"rows": rows, "mode": mode, "scale": scale}
    tokens = {}
    for name, token_sampler in (
        ("torch", TorchTokenSampler(args.vocab, DEVICE)),
        ("triton", TritonTokenSampler(args.vocab, DEVICE)),
    ):
        sampler = make_sampler(token_sampler, rows, args.vocab, params)
        tokens[name] = sampler(logits, idx, idx_np).sampled_token_ids
        times = time_calls(lambda s=sampler: s(logits, idx, idx_np), args.warmup, args.iters)
        result[f"{name}_ms"] = statistics.median(times)
        result[f"{name}_ms_min"] = min(times)
    result["speedup"] = result["torch_ms"] / result["triton_ms"]
    result["token_mismatches"] = int((tokens["torch"] != tokens["triton"]).sum())
    if not params.greedy and (params.top_k or params.top_p < 1.0 or params.min_p):
        result["kept_set_mismatches"] = kept_set_mismatches(sampler, logits, idx.long(), idx_np)
    return result


def print_table(results: list[dict]) -> None:
    header = f"{'rows':>5} {'mode':<20} {'scale':>5} {'torch ms':>9} {'triton ms':>10} " \
             f"{'speedup':>8} {'tok diff':>8} {'kept diff':>9}"
    print(header)
    print("-" * len(header))
    for r in results:
        if "error" in r:
            print(f"{r['rows']:>5} {r['mode']:<20} {r['scale']:>5} ERROR {r['error']}")
            continue
        print(f"{r['rows']:>5} {r['mode']:<20} {r['scale']:>5} {r['torch_ms']:>9.3f} "
              f"{r['triton_ms']:>10.3f} {r['speedup']:>7.1f}x {r['token_mismatches']:>8} "
              f"{r.get('kept_set_mismatches', '-'):>9}")


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sampler_bench: needs a CUDA device")
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    results = []
    for scale in args.scales:
        for rows in args.rows:
            for mode in args.modes:
                try:
                    results.append(run_case(rows, mode, scale, args))
                except Exception as e:  # one failing case must not hide the others
                    traceback.print_exc()
                    results.append({"rows": rows, "mode": mode, "scale": scale,
                                    "error": f"{type(e).__name__}: {e}"[:500]})
                print(json.dumps(results[-1]), flush=True)
    print_table(results)
    import triton

    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "vocab": args.vocab,
        "warmup": args.warmup,
        "iters": args.iters,
        "wall_s": round(time.perf_counter() - began, 1),
        "results": results,
    }
    (args.out / "sampler_bench.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out / 'sampler_bench.json'} in {report['wall_s']} s")


if __name__ == "__main__":
    main()
