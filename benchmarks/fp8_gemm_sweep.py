"""FP8 GEMMs against bf16 at the Llama-3-8B linear shapes: cuBLAS both ways and two Triton kernels.

    python benchmarks/fp8_gemm_sweep.py --out DIR [--ms 16,64,...] [--shapes qkv,o,...]

For M (tokens) in 16 .. 8192 and the weights of qkv [6144, 4096], o_proj [4096, 4096], gate_up
[28672, 4096] and down_proj [4096, 14336] (plus an 8192 x 8192 x 8192 product: the card's
matmul ceilings, bf16 and FP8), times
- ``bf16``: ``F.linear`` in bf16;
- ``rowwise``: ``torch._scaled_mm`` with a scale per token and per output channel (the
  engine's FP8 linears below ``fp8_ops.PERSISTENT_MIN_ROWS`` tokens, ``fp8_ops.scaled_mm``);
- ``tensorwise``: ``torch._scaled_mm`` with one scale per operand;
- ``engine``: what the engine's FP8 linears run at that M (``fp8_ops.rows_product``);
- ``triton <config>``: ``kernels/fp8_gemm.py`` (row-wise scales) for every launch shape of
  ``FP8_GEMM_CONFIGS``;
- ``tma <config>``: its persistent variant, operands loaded by TMA (``fp8_gemm_persistent``;
  the engine's from ``PERSISTENT_MIN_ROWS`` tokens up, at ``persistent_config_for``'s pick),
  for every launch shape of ``PERSISTENT_CONFIGS``, at M >= ``PERSISTENT_MIN_M``.
The activation comes quantized (the engine quantizes it in the RMSNorm / SiLU-and-mul kernel
before the linear), so only the product is timed. Each timing replays a CUDA graph of the
product over several distinct weight copies (together at least ``ROTATE_BYTES``, several times
the H200's 60 MB L2, so no weight is read from L2), median of 20 replays over the copies.
Each FP8 result is checked once against the fp32 product of its dequantized operands
(relative error; ``"ok": false`` past 1e-2).

Writes one JSON line per (shape, M, variant) to DIR/fp8_gemm_sweep.jsonl and prints, last, a
table of TFLOP/s and the ratio to bf16 per shape and M (each Triton kernel: its best launch
shape).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve.entrypoints.bench.graph_timing import graph_time_ms
from pagedserve.kernels.fp8_gemm import (
    FP8_GEMM_CONFIGS,
    PERSISTENT_CONFIGS,
    Fp8GemmConfig,
    fp8_gemm,
    fp8_gemm_persistent,
)
from pagedserve.layers.quantization.fp8_ops import (
    FP8_DTYPE,
    FP8_MAX,
    quantize_rows,
    rows_product,
    scaled_mm,
)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "square": (8192, 8192)}  # fmt: skip
MS = (16, 64, 128, 256, 512, 1024, 4096, 8192)
PERSISTENT_MIN_M = 256
SQUARE_M = 8192  # the square shape runs at this M only: the ceiling measurement
ROTATE_BYTES = 256 << 20
MAX_REL_ERR = 1e-2


class Operands:
    """One shape's weights (bf16 and FP8 copies) and one M's activation, in every scaling."""

    def __init__(self, n: int, k: int, copies: int) -> None:
        self.w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                    for _ in range(copies)]  # fmt: skip  # bf16 [N, K] each
        rows = [quantize_rows(w) for w in self.w16]
        self.wq = [q for q, _ in rows]  # float8 [N, K] each
        self.w_rows = [s.unsqueeze(1).contiguous() for _, s in rows]  # fp32 [N, 1] each
        self.w_tensor = [tensor_quantized(w) for w in self.w16]  # (float8 [N, K], fp32 [1])

    def set_m(self, m: int) -> None:
        k = self.w16[0].shape[1]
        self.x16 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)  # [M, K]
        xq, x_scale = quantize_rows(self.x16)
        self.xq, self.x_rows = xq, x_scale.unsqueeze(1).contiguous()  # float8 [M, K], fp32 [M, 1]
        self.x_tensor = tensor_quantized(self.x16)  # (float8 [M, K], fp32 [1])


def tensor_quantized(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [R, C] with one scale: (float8 [R, C], fp32 [1])."""
    scale = (t.float().abs().amax() / FP8_MAX).reshape(1)
    return (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def variants(ops: Operands) -> dict[str, Callable[[int], torch.Tensor]]:
    """name -> product with weight copy ``i`` (bf16 [M, N])."""
    out: dict[str, Callable[[int], torch.Tensor]] = {
        "bf16": lambda i: F.linear(ops.x16, ops.w16[i]),
        "rowwise": lambda i: scaled_mm(ops.xq, ops.x_rows, ops.wq[i], ops.w_rows[i]),
        "tensorwise": lambda i: scaled_mm(*ops.x_tensor, *ops.w_tensor[i]),
        "engine": lambda i: rows_product(ops.xq)(ops.xq, ops.x_rows, ops.wq[i], ops.w_rows[i]),
    }
    for cfg in FP8_GEMM_CONFIGS:
        out[f"triton {config_name(cfg)}"] = triton_product(ops, fp8_gemm, cfg)
    if ops.xq.shape[0] >= PERSISTENT_MIN_M:
        for cfg in PERSISTENT_CONFIGS:
            out[f"tma {config_name(cfg)}"] = triton_product(ops, fp8_gemm_persistent, cfg)
    return out


def triton_product(
    ops: Operands, gemm: Callable[..., torch.Tensor], cfg: Fp8GemmConfig
) -> Callable[[int], torch.Tensor]:
    def product(i: int) -> torch.Tensor:
        return gemm(ops.xq, ops.x_rows, ops.wq[i], ops.w_rows[i], cfg)

    return product


def all_copies(product: Callable[[int], torch.Tensor], copies: int) -> Callable[[], list]:
    """One pass of ``product`` over every weight copy (what a timed graph holds)."""
    return lambda: [product(i) for i in range(copies)]


def config_name(c: Fp8GemmConfig) -> str:
    return f"{c.block_m}x{c.block_n}x{c.block_k} g{c.group_m} w{c.num_warps} s{c.num_stages}"


def rel_err(name: str, ops: Operands, out: torch.Tensor) -> float:
    """‖out - ref‖ / ‖ref‖ against the fp32 product of the variant's dequantized operands."""
    if name == "bf16":
        ref = ops.x16.float() @ ops.w16[0].float().T
    elif name == "tensorwise":
        (xq, xs), (wq, ws) = ops.x_tensor, ops.w_tensor[0]
        ref = (xq.float() * xs) @ (wq.float() * ws).T
    else:
        ref = (ops.xq.float() * ops.x_rows) @ (ops.wq[0].float() * ops.w_rows[0]).T
    return float((out.float() - ref).norm() / ref.norm())


def sweep_shape(shape: str, ms: list[int], log: Path) -> list[dict]:
    n, k = SHAPES[shape]
    copies = max(2, math.ceil(ROTATE_BYTES / (n * k)))  # FP8 bytes; bf16 copies are twice that
    ops = Operands(n, k, copies)
    rows = []
    for m in ms:
        ops.set_m(m)
        for name, product in variants(ops).items():
            err = rel_err(name, ops, product(0))
            ms_per = graph_time_ms(all_copies(product, copies)) / copies
            row = {"shape": shape, "n": n, "k": k, "m": m, "variant": name, "ms": ms_per,
                   "tflops": 2 * m * n * k / ms_per / 1e9,
                   "weight_tb_s": n * k * (2 if name == "bf16" else 1) / ms_per / 1e9,
                   "rel_err": err, "ok": err <= MAX_REL_ERR}  # fmt: skip
            rows.append(row)
            with log.open("a") as f:
                f.write(json.dumps(row) + "\n")
        print(
            f"[{shape} M={m}] "
            + ", ".join(f"{r['variant']} {r['tflops']:.0f}" for r in rows if r["m"] == m),
            flush=True,
        )
    del ops
    torch.cuda.empty_cache()
    return rows


def cell(r: dict | None, bf16_tflops: float) -> str:
    """A variant's TFLOP/s and its ratio to bf16 (WRONG where its check failed)."""
    if r is None:
        return "-"
    flag = "" if r["ok"] else " WRONG"
    return f"{r['tflops']:.0f} ({r['tflops'] / bf16_tflops:.2f}x){flag}"


def best_of(mine: dict[str, dict], prefix: str) -> tuple[dict | None, str]:
    """The fastest correct variant named ``prefix...`` and its launch shape."""
    ok = [r for name, r in mine.items() if name.startswith(prefix) and r["ok"]]
    best = max(ok, key=lambda r: r["tflops"], default=None)
    return best, best["variant"].removeprefix(prefix) if best else "-"


def table(rows: list[dict]) -> list[str]:
    """TFLOP/s per (shape, M): bf16, rowwise, tensorwise, the engine's, best Triton; FP8 ones
    x bf16."""
    lines = ["| shape | M | bf16 | rowwise _scaled_mm | tensorwise _scaled_mm | engine | "
             "Triton best | Triton launch | TMA best | TMA launch |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for shape, m in dict.fromkeys((r["shape"], r["m"]) for r in rows):
        mine = {r["variant"]: r for r in rows if r["shape"] == shape and r["m"] == m}
        base = mine["bf16"]["tflops"]
        best, launch = best_of(mine, "triton ")
        best_tma, launch_tma = best_of(mine, "tma ")
        lines.append(f"| {shape} | {m} | {base:.0f} | {cell(mine['rowwise'], base)} | "
                     f"{cell(mine['tensorwise'], base)} | {cell(mine['engine'], base)} | "
                     f"{cell(best, base)} | {launch} | "
                     f"{cell(best_tma, base)} | {launch_tma} |")  # fmt: skip
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--ms", default=",".join(map(str, MS)), help="token counts M")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=", ".join(SHAPES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_gemm_sweep: needs a CUDA GPU with FP8 (compute capability >= 8.9)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "fp8_gemm_sweep.jsonl"
    log.write_text("")
    ms = [int(m) for m in args.ms.split(",")]
    rows: list[dict] = []
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            raise SystemExit(f"--shapes: unknown {shape!r} (one of {', '.join(SHAPES)})")
        rows += sweep_shape(shape, [SQUARE_M] if shape == "square" else ms, log)
    lines = table(rows)
    (out / "fp8_gemm_sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
