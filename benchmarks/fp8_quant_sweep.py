"""Per-token FP8 quantization kernels timed on their own, at Llama-3-8B's shapes.

    python benchmarks/fp8_quant_sweep.py --out DIR [--ts 1,64,256,1024,8192]

For T (tokens) in 1 .. 8192, times
- ``quantize``: o_proj's input, bf16 [T, 4096], quantized per token: ``fp8_ops.quantize_rows``
  in torch ops against the Triton kernel ``kernels/fp8_rows.quantize_rows_fp8`` at 4, 8 and 16
  warps;
- ``silu``: down_proj's input, bf16 [T, 28672] = gate | up (d = 14336): the bf16
  ``silu_and_mul``, the two-pass FP8 kernel (``silu_and_mul_fp8_two_pass``, the fallback for
  rows wider than 16,384) and the one-pass ``silu_and_mul_fp8`` at 4, 8, 16 and 32 warps.
Each: a CUDA graph of 10 calls on the same input (``graph_time_ms``), median of 10 replays, as
us per call and GB/s of the bytes a call must move (its input read once, its outputs written
once). The FP8 outputs are checked once per T against ``quantize_rows`` on the CPU (of the bf16
product for ``silu``): ``"ok": false`` where a byte or a scale differs.

Writes one JSON line per (op, T, variant) to DIR/fp8_quant_sweep.jsonl and prints, last, a
table of us per call (GB/s) per op and T, also written to DIR/fp8_quant_sweep.md.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pagedserve.entrypoints.bench.graph_timing import graph_time_ms
from pagedserve.kernels.fp8_rows import quantize_rows_fp8
from pagedserve.kernels.silu_and_mul import (
    silu_and_mul,
    silu_and_mul_fp8,
    silu_and_mul_fp8_two_pass,
)
from pagedserve.layers.quantization.fp8_ops import quantize_rows

TS = (1, 64, 256, 1024, 8192)
HIDDEN = 4096  # o_proj's input width
FFN = 14336  # d of the SiLU-and-mul: its input is [T, 2 * FFN]
QUANTIZE_WARPS = (4, 8, 16)
SILU_WARPS = (4, 8, 16, 32)
LAUNCHES = 10  # calls per timed graph
BF16 = torch.bfloat16
DEVICE = "cuda"  # where the inputs live
REPS = 10  # timed replays of each graph


def quantize_variants(x: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """name -> one quantization of x bf16 [T, HIDDEN]: (float8 [T, HIDDEN], fp32 scales)."""
    out: dict[str, Callable[[], Any]] = {"torch": functools.partial(quantize_rows, x)}
    for w in QUANTIZE_WARPS:
        out[f"triton w{w}"] = functools.partial(quantize_rows_fp8, x, w)
    return out


def silu_variants(x: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """name -> one SiLU-and-mul of x bf16 [T, 2 * FFN]: bf16 [T, FFN] or (float8 [T, FFN],
    fp32 [T, 1])."""
    out: dict[str, Callable[[], Any]] = {
        "bf16": functools.partial(silu_and_mul, x),
        "fp8 two-pass": functools.partial(silu_and_mul_fp8_two_pass, x),
    }
    for w in SILU_WARPS:
        out[f"fp8 one-pass w{w}"] = functools.partial(silu_and_mul_fp8, x, w)
    return out


def bytes_moved(op: str, variant: str, t: int) -> int:
    """The bytes one call must read and write: bf16 input, bf16 or FP8 output, fp32 scales."""
    if op == "quantize":
        return t * HIDDEN * 2 + t * HIDDEN + t * 4
    if variant == "bf16":
        return t * 2 * FFN * 2 + t * FFN * 2
    return t * 2 * FFN * 2 + t * FFN + t * 4


def same_quantization(result: Any, want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """result (float8 [T, C], scales [T] or [T, 1]) has ``want``'s bytes and scales."""
    q, scale = (t.cpu() for t in result)
    want_q, want_scale = want
    return torch.equal(scale.reshape(-1), want_scale.reshape(-1)) and torch.equal(
        q.view(torch.uint8), want_q.view(torch.uint8)
    )


def us_per_call(fn: Callable[[], Any]) -> float:
    """us of one call: a CUDA graph of LAUNCHES calls, median of REPS replays."""
    return graph_time_ms(lambda: [fn() for _ in range(LAUNCHES)], REPS) * 1e3 / LAUNCHES


def sweep_t(t: int, log: Path, device: str) -> list[dict]:
    """Every variant of both ops at T = t."""
    x_q = torch.randn(t, HIDDEN, device=DEVICE, dtype=BF16) * 3  # [T, HIDDEN]
    x_silu = torch.randn(t, 2 * FFN, device=DEVICE, dtype=BF16) * 3  # [T, 2 * FFN]
    # The reference bytes come from the CPU, as the kernel tests take them: on CUDA, torch
    # divides by the Python scalar FP8_MAX as a multiply by its reciprocal, so some of its
    # scales are a rounding step off the kernels' IEEE division.
    cases = [
        ("quantize", quantize_variants(x_q), quantize_rows(x_q.cpu())),
        ("silu", silu_variants(x_silu), quantize_rows(silu_and_mul(x_silu).cpu())),
    ]
    rows = []
    for op, variants, want in cases:
        for name, fn in variants.items():
            ok = None if name == "bf16" else same_quantization(fn(), want)
            us = us_per_call(fn)
            gb_s = bytes_moved(op, name, t) / us / 1e3
            row = {"op": op, "t": t, "variant": name, "us": us, "gb_s": gb_s, "ok": ok,
                   "device": device}  # fmt: skip
            rows.append(row)
            with log.open("a") as f:
                f.write(json.dumps(row) + "\n")
        timings = [f"{r['variant']} {r['us']:.1f} us" for r in rows if r["op"] == op]
        print(f"[{op} T={t}] " + ", ".join(timings), flush=True)
    return rows


def table(rows: list[dict]) -> list[str]:
    """Per op, one line per T: us per call (GB/s) of each variant; WRONG where the check failed."""
    lines: list[str] = []
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        names = list(dict.fromkeys(r["variant"] for r in mine))
        lines += [f"\n{op}: us per call (GB/s)", "| T | " + " | ".join(names) + " |",
                  "|---" * (len(names) + 1) + "|"]  # fmt: skip
        for t in dict.fromkeys(r["t"] for r in mine):
            cells = []
            for name in names:
                r = next(r for r in mine if r["t"] == t and r["variant"] == name)
                flag = " WRONG" if r["ok"] is False else ""
                cells.append(f"{r['us']:.1f} ({r['gb_s']:.0f}){flag}")
            lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".", help="folder for the JSON lines and the table")
    parser.add_argument("--ts", default=",".join(map(str, TS)), help="token counts T")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_quant_sweep: needs a CUDA GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "fp8_quant_sweep.jsonl"
    log.write_text("")
    device = torch.cuda.get_device_name()
    rows: list[dict] = []
    for t in (int(t) for t in args.ts.split(",")):
        rows += sweep_t(t, log, device)
        torch.cuda.empty_cache()
    lines = [f"fp8_quant_sweep on {device}", *table(rows)]
    (out / "fp8_quant_sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
