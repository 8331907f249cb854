"""Tile sweep of the decode GEMV kernels (``pagedserve/kernels/gemv.py``) against cuBLAS.

    python benchmarks/gemv_sweep.py --out DIR [--quick]

Llama-3-8B shapes, dummy bf16 weights, 32 distinct weights per shape (as many as the model's
layers, 1-7.5 GB per shape: nothing stays in L2). Each timing replays a CUDA graph of the 32
products of one shape (median of 20 replays / 32), so launch gaps inside a graph count as they
do in the engine's FULL graphs. Prints and writes (``gemv_sweep.json``) per shape: cuBLAS
(``F.linear``, one token) and the fused kernel that serves that layer (RMSNorm + QKV + rotary +
KV write, o_proj + residual, RMSNorm + gate/up + SiLU-and-mul, down_proj + residual) for every
tile config, with the bytes read per second and the ratio to the card's measured copy
bandwidth. Then the whole linear work of one decode step (32 layers + LM head) as one graph:
cuBLAS vs the fused kernels with the best tiles, with and without programmatic dependent
launch. The engine's tiles (``gemv.DEFAULT_CONFIGS``) are this sweep's winners.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve.entrypoints.bench.graph_timing import graph_time_ms
from pagedserve.entrypoints.bench.roofline import MEASURED_CEILINGS
from pagedserve.kernels import gemv

COPY_BANDWIDTH = MEASURED_CEILINGS["H200"][0]

LAYERS = 32
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
LM_HEAD = (128256, 4096)


def configs(quick: bool) -> list[gemv.GemvConfig]:
    grid = itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8))
    if quick:
        grid = itertools.product((8, 16), (512,), (4,))
    return [gemv.GemvConfig(bn, bk, nw) for bn, bk, nw in grid]


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


def fused_call(name: str, t: StepTensors, w: torch.Tensor, cfg: gemv.GemvConfig | None):
    """The fused kernel that serves ``name`` in a decode layer."""
    if name == "qkv":
        return gemv.rmsnorm_qkv_rope_kv_write(t.h, t.gamma, 1e-5, w, None, t.cos_sin,
                                              t.positions, t.slots, t.cache, 32, config=cfg)
    if name == "o":
        return gemv.linear_row(t.attn, w, residual=t.h, config=cfg)
    if name == "gate_up":
        return gemv.rmsnorm_gate_up_silu(t.h, t.gamma, 1e-5, w, config=cfg)
    return gemv.linear_row(t.act, w, residual=t.h, config=cfg)


def sweep_shape(name: str, weights: list[torch.Tensor], t: StepTensors, quick: bool) -> dict:
    n, k = weights[0].shape
    x = t.act if name == "down" else t.h
    nbytes = n * k * 2
    out: dict = {"shape": [n, k], "bytes": nbytes}
    ms = graph_time_ms(lambda: [F.linear(x, w) for w in weights]) / LAYERS
    out["cublas_us"] = ms * 1e3
    out["cublas_of_copy_bw"] = nbytes / (ms * 1e-3) / COPY_BANDWIDTH
    results = []
    for cfg in configs(quick):
        if name == "qkv" and 64 % cfg.block_n:
            continue
        try:
            ms = graph_time_ms(lambda c=cfg: [fused_call(name, t, w, c) for w in weights])
        except Exception as e:  # a tile that does not compile (registers, shared memory)
            results.append({"config": cfg.__dict__, "error": str(e)[:200]})
            continue
        ms /= LAYERS
        results.append({"config": cfg.__dict__, "us": ms * 1e3,
                        "of_copy_bw": nbytes / (ms * 1e-3) / COPY_BANDWIDTH})
    ok = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
    out["configs"] = ok + [r for r in results if "us" not in r]
    best = ok[0] if ok else None
    print(f"{name:8s}: cuBLAS {out['cublas_us']:.1f} us ({out['cublas_of_copy_bw']:.3f} of copy "
          f"bw); fused best {best and best['config']} {best and round(best['us'], 1)} us "
          f"({best and round(best['of_copy_bw'], 3)})", flush=True)
    return out


def check_fused(t: StepTensors, weights: dict) -> dict:
    """The fused kernels against torch on the card (compiled, not the interpreter)."""
    x = t.h.float()
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    errs = {}
    gu = F.linear(normed, weights["gate_up"][0])
    want = F.silu(gu[:, :14336]) * gu[:, 14336:]
    errs["gate_up"] = rel_err(fused_call("gate_up", t, weights["gate_up"][0], None), want)
    want = (F.linear(t.act.float(), weights["down"][0].float()) + x).to(torch.bfloat16)
    errs["down"] = rel_err(fused_call("down", t, weights["down"][0], None), want)
    q = fused_call("qkv", t, weights["qkv"][0], None)
    errs["qkv_v_head0"] = rel_err(t.cache[1, 0, 5, 0],
                                  F.linear(normed, weights["qkv"][0])[0, 5120:5248])
    errs["q_finite"] = float(torch.isfinite(q).all().item())
    print("fused kernels vs torch (max abs err / max abs):", errs, flush=True)
    return errs


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def step_chain(weights: dict, lm_head: torch.Tensor, t: StepTensors, best: dict) -> dict:
    """One decode step's linear work (32 layers + LM head): cuBLAS GEMMs vs the fused kernels
    with each shape's best tile, with and without programmatic dependent launch."""

    def cublas() -> None:
        for i in range(LAYERS):
            for name in SHAPES:
                F.linear(t.act if name == "down" else t.h, weights[name][i])
        F.linear(t.h, lm_head)

    def fused() -> None:
        for i in range(LAYERS):
            for name in SHAPES:
                fused_call(name, t, weights[name][i], best[name])
        F.linear(t.h, lm_head)

    floor_bytes = sum(n * k * 2 for n, k in SHAPES.values()) * LAYERS + lm_head.numel() * 2
    floor_ms = floor_bytes / COPY_BANDWIDTH * 1e3
    result = {"weight_read_floor_ms": floor_ms, "cublas_ms": graph_time_ms(cublas),
              "fused_pdl_ms": graph_time_ms(fused)}
    pdl = gemv.uses_pdl
    gemv.uses_pdl = lambda device: False
    try:
        result["fused_no_pdl_ms"] = graph_time_ms(fused)
    finally:
        gemv.uses_pdl = pdl
    print(f"step: cuBLAS {result['cublas_ms']:.3f} ms, fused {result['fused_pdl_ms']:.3f} ms "
          f"(without PDL {result['fused_no_pdl_ms']:.3f}), floor {floor_ms:.3f} ms", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    start = time.perf_counter()
    weights = {name: [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / 64
                      for _ in range(LAYERS)] for name, (n, k) in SHAPES.items()}
    lm_head = torch.randn(*LM_HEAD, dtype=torch.bfloat16, device="cuda") / 64
    t = StepTensors()
    report: dict = {"device": torch.cuda.get_device_name(), "check": check_fused(t, weights),
                    "shapes": []}
    path = args.out / "gemv_sweep.json"
    best = {}
    for name, ws in weights.items():
        res = sweep_shape(name, ws, t, args.quick)
        report["shapes"].append({"name": name, **res})
        path.write_text(json.dumps(report, indent=1))
        top = [c for c in res["configs"] if "us" in c]
        best[name] = gemv.GemvConfig(**top[0]["config"]) if top else None
    report["step"] = step_chain(weights, lm_head, t, best)
    path.write_text(json.dumps(report, indent=1))
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
