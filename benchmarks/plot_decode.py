"""Plot decode output tokens/s against batch size: ours, the roofline and the reference figures.

    python benchmarks/plot_decode.py benchmarks/results/<run>/profile.json --out decode.png

Ours: the ``sweep`` of ``benchmarks/gpu_profile.py`` (the mean engine step time at context
1024, Llama-3-8B shape, dummy bf16 weights, on one H200). Roofline: ``decode_step_roofline``
of ``pagedserve/entrypoints/bench/roofline.py`` with the measured H200 ceilings (weights once per
step plus every KV read, or the matmul FLOPs when larger). References (measured on the same
card kind, same shape, bf16): gpt-fast at context ~1000, cuBLAS linear layers + LM head as one CUDA graph
(no attention: an upper bound for any engine's decode), transformers eager at batch 1.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pagedserve.entrypoints.bench.roofline import (
    MEASURED_CEILINGS,
    Ceilings,
    decode_step_roofline,
)
from pagedserve.model.shape import ModelShape

LLAMA_3_8B = ModelShape(num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                        ffn=14336, vocab=128256)  # fmt: skip
CONTEXT = 1024
# batch -> step ms of the reference engines (H200, Llama-3-8B shape, bf16).
GPT_FAST_MS = {1: 5.58, 32: 16.03, 64: 26.33}
CUBLAS_GRAPH_MS = {1: 3.95, 64: 4.10, 128: 5.63, 256: 6.80}
TRANSFORMERS_EAGER_MS = {1: 87.7}


def tokens_per_s(step_ms: dict[int, float]) -> tuple[list[int], list[float]]:
    batches = sorted(step_ms)
    return batches, [b / step_ms[b] * 1e3 for b in batches]


BEFORE_LABEL = "pagedserve, compiled forward at batch 1 too (--one-token-step compiled)"


def plot(
    sweep: dict[int, float],
    out: Path,
    before: dict[int, float] | None = None,
    before_label: str = BEFORE_LABEL,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bandwidth, flops = MEASURED_CEILINGS["H200"]
    ceil = Ceilings(bandwidth, flops, "H200")
    roof = {b: decode_step_roofline(LLAMA_3_8B, b, CONTEXT, ceil) * 1e3 for b in sweep}
    fig, ax = plt.subplots(figsize=(7.5, 5))
    series = [
        ("roofline (4.25 TB/s, 800 TFLOP/s)", roof, "k--"),
        ("cuBLAS linear layers + LM head, one graph (no attention)", CUBLAS_GRAPH_MS, "s:"),
        ("pagedserve (engine step, async scheduling)", sweep, "o-"),
        *([(before_label, before, "o:")] if before else []),
        ("gpt-fast", GPT_FAST_MS, "^-"),
        ("transformers eager", TRANSFORMERS_EAGER_MS, "v"),
    ]
    for label, step_ms, style in series:
        x, y = tokens_per_s(step_ms)
        ax.plot(x, y, style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (requests decoding together)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Decode throughput, Llama-3-8B shape, bf16, context {CONTEXT}, one H200")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    for b in sorted(sweep):
        print(f"batch {b:>3}: ours {sweep[b]:.2f} ms ({b / sweep[b] * 1e3:,.0f} tok/s), "
              f"roofline {roof[b]:.2f} ms: {roof[b] / sweep[b]:.2f} of roofline")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("profile_json", help="gpu_profile.py's profile.json (with a sweep)")
    parser.add_argument("--out", default="decode_throughput.png")
    parser.add_argument("--before", help="a second profile.json, drawn dotted (e.g. the same "
                                         "sweep with --one-token-step compiled)")
    parser.add_argument("--before-label", default=BEFORE_LABEL,
                        help="the legend of the --before sweep")
    args = parser.parse_args()
    sweeps = [json.loads(Path(p).read_text())["sweep"] for p in (args.profile_json, args.before)
              if p is not None]
    as_ms = [{int(b): float(ms) for b, ms in s.items()} for s in sweeps]
    plot(as_ms[0], Path(args.out), as_ms[1] if len(as_ms) > 1 else None, args.before_label)


if __name__ == "__main__":
    main()
