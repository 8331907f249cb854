"""Tile sweep of the decode GEMV kernels (``pagedserve/kernels/gemv.py``) against cuBLAS.

    python benchmarks/gemv_sweep.py --out DIR [--weights bf16|fp8] [--quick]

Llama-3-8B shapes, dummy weights (bf16, or float8_e4m3fn with an fp32 scale per row as
``--quantization fp8`` stores them), 32 distinct weights per shape (as many as the model's
layers, 0.5-7.5 GB per shape: nothing stays in L2). Each timing replays a CUDA graph of the 32
products of one shape (median of 20 replays / 32), so launch gaps inside a graph count as they
do in the engine's FULL graphs. Prints and writes (``gemv_sweep_<weights>.json``) per shape:
cuBLAS (bf16: ``F.linear``; fp8: the engine's ``scaled_mm_linear``, one token) and the fused
kernel that serves that layer (RMSNorm + QKV + rotary + KV write, o_proj + residual, RMSNorm +
gate/up + SiLU-and-mul, down_proj + residual) for every tile config, with the bytes read per
second (weight bytes: 2 or 1 per element) and the ratio to the card's measured copy bandwidth.
The two best tiles of each shape are then tried with ``num_stages=2`` and (fp8) with the
weights widened through fp16. Then the LM head (the engine keeps it in the model dtype and
runs it on cuBLAS; here also the fused kernel on it in the swept weight dtype), and the whole
linear work of one decode step (32 layers + the bf16 LM head on cuBLAS) as one graph: cuBLAS
vs the fused kernels with the best tiles, with and without programmatic dependent launch.

The last lines printed are the tile table to put into ``gemv.py`` (``DEFAULT_CONFIGS`` for
bf16, ``FP8_CONFIGS`` for fp8): one tile per epilogue, o_proj and down_proj sharing one.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve.entrypoints.bench.graph_timing import graph_time_ms
from pagedserve.entrypoints.bench.roofline import MEASURED_CEILINGS
from pagedserve.kernels import gemv
from pagedserve.layers.quantization.fp8_ops import (
    dequantize_rows,
    quantize_rows,
    scaled_mm_linear,
)

COPY_BANDWIDTH = MEASURED_CEILINGS["H200"][0]

LAYERS = 32
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
LM_HEAD = (128256, 4096)
EPILOGUES = {"qkv": gemv.EPILOGUE_ROPE_KV, "o": gemv.EPILOGUE_STORE,
             "gate_up": gemv.EPILOGUE_SILU_MUL, "down": gemv.EPILOGUE_STORE}
WEIGHT_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
FP8_ACC_PER_THREAD = (32, 128)
"""FP8 grid: fp32 partial sums per thread (BLOCK_N * BLOCK_K * weight rows per output / threads)
from 32 (a program's loads move at least as many bytes as bf16's smallest winners) to 128
(beyond that the accumulators spill)."""


@dataclasses.dataclass(frozen=True)
class Weight:
    """One layer's weight as the kernels read it; ``scale``: fp32 [N] for FP8 weights."""

    w: torch.Tensor
    scale: torch.Tensor | None

    def dense(self) -> torch.Tensor:
        """The weight in fp32 (dequantized for FP8): the reference's."""
        return self.w.float() if self.scale is None else dequantize_rows(self.w, self.scale)

    def cublas(self, x: torch.Tensor) -> torch.Tensor:
        """The engine's GEMM for this weight at one token."""
        if self.scale is None:
            return F.linear(x, self.w)
        return scaled_mm_linear(x, self.w, self.scale, None, None)


def make_weight(n: int, k: int, weights: str) -> Weight:
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / 64
    if weights == "bf16":
        return Weight(w, None)
    return Weight(*quantize_rows(w))


def configs(weights: str, epilogue: int, quick: bool) -> list[gemv.GemvConfig]:
    if weights == "bf16":
        grid = itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8))
        if quick:
            grid = itertools.product((8, 16), (512,), (4,))
        return [gemv.GemvConfig(bn, bk, nw) for bn, bk, nw in grid]
    grid = itertools.product((2, 4, 8, 16, 32), (512, 1024, 2048, 4096), (4, 8))
    if quick:
        grid = itertools.product((4, 8), (1024, 2048), (4,))
    rows = 1 if epilogue == int(gemv.EPILOGUE_STORE) else 2
    low, high = FP8_ACC_PER_THREAD
    return [gemv.GemvConfig(bn, bk, nw) for bn, bk, nw in grid
            if low <= bn * bk * rows // (32 * nw) <= high]


def variants(weights: str, cfg: gemv.GemvConfig) -> list[gemv.GemvConfig]:
    """A good tile with software pipelining, and (FP8) with the weights widened through fp16."""
    out = [dataclasses.replace(cfg, num_stages=2)]
    if weights == "fp8":
        out.append(dataclasses.replace(cfg, weight_via="float16"))
    return out


class StepTensors:
    """The inputs one decode layer's fused kernels read (one token, a KV cache to write)."""

    def __init__(self) -> None:
        dev, dt = "cuda", torch.bfloat16
        self.h = torch.randn(1, 4096, dtype=dt, device=dev)
        self.gamma = torch.ones(4096, dtype=dt, device=dev)
        self.cos_sin = torch.randn(8192, 128, dtype=dt, device=dev)
        self.positions = torch.tensor([1000], dtype=torch.int64, device=dev)
        self.slots = torch.tensor([5], dtype=torch.int64, device=dev)
        self.cache = torch.zeros(2, 64, 16, 8, 128, dtype=dt, device=dev)
        self.attn = torch.randn(1, 4096, dtype=dt, device=dev)
        self.act = torch.randn(1, 14336, dtype=dt, device=dev)

    def input_of(self, name: str) -> torch.Tensor:
        return self.act if name == "down" else self.h


def fused_call(name: str, t: StepTensors, w: Weight, cfg: gemv.GemvConfig | None):
    """The fused kernel that serves ``name`` in a decode layer."""
    if name == "qkv":
        return gemv.rmsnorm_qkv_rope_kv_write(t.h, t.gamma, 1e-5, w.w, None, t.cos_sin,
                                              t.positions, t.slots, t.cache, 32, config=cfg,
                                              weight_scale=w.scale)
    if name == "o":
        return gemv.linear_row(t.attn, w.w, residual=t.h, config=cfg, weight_scale=w.scale)
    if name == "gate_up":
        return gemv.rmsnorm_gate_up_silu(t.h, t.gamma, 1e-5, w.w, config=cfg,
                                         weight_scale=w.scale)
    return gemv.linear_row(t.act, w.w, residual=t.h, config=cfg, weight_scale=w.scale)


def time_configs(cfgs: list[gemv.GemvConfig], products: Callable[[gemv.GemvConfig], object],
                 count: int, nbytes: int) -> list[dict]:
    """us per product (``products(cfg)`` runs ``count`` of them) of each tile."""
    results = []
    for cfg in cfgs:
        try:
            ms = graph_time_ms(lambda c=cfg: products(c)) / count
        except Exception as e:  # a tile that does not compile (registers, shared memory)
            results.append({"config": dataclasses.asdict(cfg), "error": str(e)[:200]})
            continue
        results.append({"config": dataclasses.asdict(cfg), "us": ms * 1e3,
                        "of_copy_bw": nbytes / (ms * 1e-3) / COPY_BANDWIDTH})
    return results


def ranked(results: list[dict]) -> list[dict]:
    ok = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
    return ok + [r for r in results if "us" not in r]


def sweep_shape(name: str, weights: list[Weight], t: StepTensors, kind: str,
                quick: bool) -> dict:
    n, k = weights[0].w.shape
    x = t.input_of(name)
    nbytes = n * k * weights[0].w.element_size()
    out: dict = {"shape": [n, k], "bytes": nbytes}
    try:
        ms = graph_time_ms(lambda: [w.cublas(x) for w in weights]) / LAYERS
        out["cublas_us"] = ms * 1e3
        out["cublas_of_copy_bw"] = nbytes / (ms * 1e-3) / COPY_BANDWIDTH
    except Exception as e:  # _scaled_mm without a kernel for this shape
        out["cublas_error"] = str(e)[:200]
    cfgs = configs(kind, int(EPILOGUES[name]), quick)
    if name == "qkv":
        cfgs = [c for c in cfgs if 64 % c.block_n == 0]

    def products(cfg: gemv.GemvConfig) -> list:
        return [fused_call(name, t, w, cfg) for w in weights]

    results = ranked(time_configs(cfgs, products, LAYERS, nbytes))
    top = [gemv.GemvConfig(**r["config"]) for r in results[:2] if "us" in r]
    extra = [v for cfg in top for v in variants(kind, cfg)]
    out["configs"] = ranked(results + time_configs(extra, products, LAYERS, nbytes))
    best = out["configs"][0] if "us" in out["configs"][0] else None
    cublas = f"{out['cublas_us']:.1f} us" if "cublas_us" in out else "failed"
    print(f"{name:8s}: cuBLAS {cublas}; fused best {best and best['config']} "
          f"{best and round(best['us'], 1)} us ({best and round(best['of_copy_bw'], 3)} of copy "
          "bw)", flush=True)
    return out


def check_fused(t: StepTensors, weights: dict[str, list[Weight]]) -> dict:
    """The fused kernels against torch on the card (compiled, not the interpreter), on the
    dequantized weights for FP8."""
    x = t.h.float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    errs = {}
    gu = F.linear(normed, weights["gate_up"][0].dense())
    want = F.silu(gu[:, :14336]) * gu[:, 14336:]
    errs["gate_up"] = rel_err(fused_call("gate_up", t, weights["gate_up"][0], None), want)
    want = F.linear(t.act.float(), weights["down"][0].dense()) + x
    errs["down"] = rel_err(fused_call("down", t, weights["down"][0], None), want)
    q = fused_call("qkv", t, weights["qkv"][0], None)
    errs["qkv_v_head0"] = rel_err(t.cache[1, 0, 5, 0],
                                  F.linear(normed, weights["qkv"][0].dense())[0, 5120:5248])
    errs["q_finite"] = float(torch.isfinite(q).all().item())
    print("fused kernels vs torch (max abs err / max abs):", errs, flush=True)
    return errs


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def lm_head_timings(t: StepTensors, kind: str, store_tiles: list[gemv.GemvConfig]) -> dict:
    """The LM head on cuBLAS in bf16 (as the engine runs it), and the fused kernel on it in the
    swept weight dtype with the best o/down tiles (4 products per graph: it is 0.5-1 GB)."""
    n, k = LM_HEAD
    bf16 = make_weight(n, k, "bf16")
    ms = graph_time_ms(lambda: [bf16.cublas(t.h) for _ in range(4)]) / 4
    out: dict = {"cublas_bf16_us": ms * 1e3}
    w = bf16 if kind == "bf16" else make_weight(n, k, kind)
    results = time_configs(
        store_tiles, lambda c: [gemv.linear_row(t.h, w.w, config=c, weight_scale=w.scale)
                                for _ in range(4)], 4, n * k * w.w.element_size())
    out["fused"] = ranked(results)
    best = out["fused"][0] if "us" in out["fused"][0] else None
    print(f"lm_head : cuBLAS bf16 {ms * 1e3:.1f} us; fused {kind} best "
          f"{best and best['config']} {best and round(best['us'], 1)} us", flush=True)
    return out


def step_chain(weights: dict[str, list[Weight]], t: StepTensors, best: dict) -> dict:
    """One decode step's linear work (32 layers + the bf16 LM head): cuBLAS GEMMs vs the fused
    kernels with each shape's best tile, with and without programmatic dependent launch."""
    lm_head = make_weight(*LM_HEAD, "bf16")

    def cublas() -> None:
        for i in range(LAYERS):
            for name in SHAPES:
                weights[name][i].cublas(t.input_of(name))
        lm_head.cublas(t.h)

    def fused() -> None:
        for i in range(LAYERS):
            for name in SHAPES:
                fused_call(name, t, weights[name][i], best[name])
        lm_head.cublas(t.h)

    layer_bytes = sum(ws[0].w.numel() * ws[0].w.element_size() for ws in weights.values())
    floor_bytes = layer_bytes * LAYERS + lm_head.w.numel() * 2
    floor_ms = floor_bytes / COPY_BANDWIDTH * 1e3
    result: dict = {"weight_read_floor_ms": floor_ms, "fused_pdl_ms": graph_time_ms(fused)}
    try:
        result["cublas_ms"] = graph_time_ms(cublas)
    except Exception as e:
        result["cublas_error"] = str(e)[:200]
    pdl = gemv.uses_pdl
    gemv.uses_pdl = lambda device: False
    try:
        result["fused_no_pdl_ms"] = graph_time_ms(fused)
    finally:
        gemv.uses_pdl = pdl
    print(f"step: cuBLAS {result.get('cublas_ms', float('nan')):.3f} ms, fused "
          f"{result['fused_pdl_ms']:.3f} ms (without PDL {result['fused_no_pdl_ms']:.3f}), "
          f"floor {floor_ms:.3f} ms ({floor_ms / result['fused_pdl_ms']:.2f} of it)", flush=True)
    return result


def store_winners(shapes: dict[str, dict]) -> list[dict]:
    """Tiles measured on both o_proj and down_proj, fastest summed time first (one epilogue, so
    one tile serves both)."""
    times: dict[str, list] = {}
    for name in ("o", "down"):
        for r in shapes[name]["configs"]:
            if "us" in r:
                times.setdefault(json.dumps(r["config"], sort_keys=True), []).append(r["us"])
    both = [(sum(us), key) for key, us in times.items() if len(us) == 2]
    return [{"config": dataclasses.asdict(gemv.GemvConfig(**json.loads(key))),
             "o_plus_down_us": us} for us, key in sorted(both)]


def table_text(kind: str, shapes: dict[str, dict], store: list[dict]) -> str:
    """The tile table to paste into gemv.py."""
    picks = {"EPILOGUE_STORE": (store[0]["config"], "o_proj + down_proj"),
             "EPILOGUE_SILU_MUL": (shapes["gate_up"]["configs"][0]["config"], "gate_up"),
             "EPILOGUE_ROPE_KV": (shapes["qkv"]["configs"][0]["config"], "qkv")}
    lines = [f"{'DEFAULT' if kind == 'bf16' else 'FP8'}_CONFIGS = {{"]
    for epilogue, (cfg, what) in picks.items():
        args = ", ".join(f"{k}={v!r}" for k, v in cfg.items()
                         if v != getattr(gemv.GemvConfig, k, None))
        lines.append(f"    int({epilogue}): GemvConfig({args}),  # {what}")
    return "\n".join(lines + ["}"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--weights", choices=sorted(WEIGHT_DTYPES), default="bf16")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    start = time.perf_counter()
    weights = {name: [make_weight(n, k, args.weights) for _ in range(LAYERS)]
               for name, (n, k) in SHAPES.items()}
    t = StepTensors()
    report: dict = {"device": torch.cuda.get_device_name(), "weights": args.weights,
                    "check": check_fused(t, weights), "shapes": {}}
    path = args.out / f"gemv_sweep_{args.weights}.json"
    best = {}
    for name, ws in weights.items():
        res = sweep_shape(name, ws, t, args.weights, args.quick)
        report["shapes"][name] = res
        path.write_text(json.dumps(report, indent=1))
        top = res["configs"][0]
        best[name] = gemv.GemvConfig(**top["config"]) if "us" in top else None
        print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    store = store_winners(report["shapes"])
    report["store_tiles"] = store
    report["lm_head"] = lm_head_timings(
        t, args.weights, [gemv.GemvConfig(**s["config"]) for s in store[:3]])
    report["step"] = step_chain(weights, t, best)
    report["table"] = table_text(args.weights, report["shapes"], store)
    path.write_text(json.dumps(report, indent=1))
    print(f"total {time.perf_counter() - start:.0f} s; tiles for gemv.py:\n{report['table']}")


if __name__ == "__main__":
    main()
