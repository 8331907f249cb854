"""Can decode attention and prefill GEMMs run side by side on disjoint sets of SMs?

    python benchmarks/partition_probe.py --out DIR

Session 5 measured that two streams do not overlap our kernels: each one fills every SM. Here the
card is split instead: the attention runs as a *persistent* kernel of G programs (each loops over
(request, kv head) items, so it holds at most G SMs: ``decode_batch.launch``; session 6's
figures came from an equivalent loop on the engine's ``attend_kv_range``), and cuBLAS is told
to target N - c SMs (``torch._C._set_sm_carveout_experimental(c)``, N the card's SM count).
Llama-3-8B shape, bf16, 32 layers:
  attention: the decode batch's attention (256 requests, context 1500: 50 GB of KV per pass),
      persistent with G programs and several launch shapes, against the engine's split-KV
      launch; answers how many SMs a full-bandwidth read needs;
  gemm: a prefill chunk's four GEMMs per layer (qkv, o, gate_up, down at M = P rows) with the
      carveout c, on the default cuBLAS path and on cuBLASLt; answers whether the SM target
      is honoured;
  together: the GEMM chain (carveout c) on one stream and the attention (G programs) on
      another, both CUDA graphs, against one after the other (G = k x c programs for each k of
      ``--programs-per-sm``: can k programs on each SM the GEMMs leave read the KV at the
      card's bandwidth?); ``--tma WARPS STAGES BLOCKS`` uses ``decode_tma.py``'s attention
      there. The hidden fraction is (attention + gemm - together) / min(attention, gemm): 1 is
      a perfect overlap.
Writes ``partition_probe.json``; what it means: BENCHMARKS.md, session 6.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from decode_batch import FFN, HIDDEN, LAYERS, QKV, DecodeBatch
from graph_timing import (
    COPY_BANDWIDTH,
    MATMUL_PEAK,
    capture_graph,
    carved_graph,
    graph_time_ms,
    median_ms,
)
from overlap_probe import fork_join, layer_weights

REPS = 15


class PrefillGemms:
    """A prefill chunk's qkv, o, gate_up and down GEMMs for 32 layers (activations reused)."""

    def __init__(self, rows: int) -> None:
        dev, dt = "cuda", torch.bfloat16
        self.weights = layer_weights()
        self.x = torch.randn(rows, HIDDEN, dtype=dt, device=dev)  # [rows, HIDDEN]
        self.ffn_in = torch.randn(rows, FFN, dtype=dt, device=dev)  # [rows, FFN]
        self.outs = [torch.empty(rows, n, dtype=dt, device=dev)  # [rows, out features]
                     for n in (QKV, HIDDEN, 2 * FFN, HIDDEN)]
        self.flops = 2 * rows * LAYERS * HIDDEN * (QKV + HIDDEN + 2 * FFN + FFN)

    def run(self) -> None:
        for layer in self.weights:
            for weight, out in zip(layer, self.outs, strict=True):
                x = self.ffn_in if weight.shape[1] == FFN else self.x
                torch.matmul(x, weight.t(), out=out)


def attention_rows(decode: DecodeBatch, sms: int, prefetch: bool) -> dict:
    ref = decode.out.clone()
    decode.engine(8)()
    ref.copy_(decode.out)
    rows = {}
    for splits in (1, 4, 8):
        rows[f"engine_splits{splits}"] = graph_time_ms(decode.engine(splits), REPS)
    shapes = [(64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3), (32, 4, 4), (64, 8, 4)]
    for tile_n, warps, stages in shapes:
        for frac in (0.25, 0.375, 0.5, 0.75, 1, 2):
            programs = max(1, int(sms * frac))
            fn = decode.persistent(programs, tile_n, warps, stages, prefetch)
            fn()
            err = (decode.out.float() - ref.float()).abs().max().item()
            ms = graph_time_ms(fn, REPS)
            rows[f"persist_t{tile_n}w{warps}s{stages}_g{programs}"] = ms
            print(f"  attention t{tile_n} w{warps} s{stages} G={programs}: {ms:.2f} ms "
                  f"({decode.kv_bytes / (ms * 1e-3) / COPY_BANDWIDTH:.2f} of copy bw, "
                  f"max err {err:.3g})", flush=True)
    return rows


def gemm_rows(gemms: PrefillGemms, sms: int, carveouts: list[int]) -> dict:
    rows = {}
    for backend in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(backend)
        for c in carveouts:
            ms = median_ms(carved_graph(gemms.run, c).replay, REPS)
            rows[f"{backend}_c{c}"] = ms
            print(f"  gemm {backend} carveout {c} ({sms - c} SMs): {ms:.2f} ms "
                  f"({gemms.flops / (ms * 1e-3) / MATMUL_PEAK:.2f} of peak)", flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    return rows


def pair_row(g_attn: torch.cuda.CUDAGraph, g_gemm: torch.cuda.CUDAGraph,
             streams: list[torch.cuda.Stream]) -> dict:
    """Each graph alone, then both at once on two streams (the GEMMs launched first)."""
    a, g = median_ms(g_attn.replay, REPS), median_ms(g_gemm.replay, REPS)
    both = median_ms(lambda: fork_join([(streams[0], g_gemm.replay),
                                        (streams[1], g_attn.replay)]), REPS)
    return {"attention_ms": a, "gemm_ms": g, "together_ms": both,
            "hidden": (a + g - both) / min(a, g)}


def together_rows(decode: DecodeBatch, gemms: PrefillGemms, carveouts: list[int],
                  attention: Callable[[int], Callable[[], None]], backend: str,
                  per_sm: list[int]) -> dict:
    """``attention(G)``: the 32 layers' persistent attention with G programs."""
    torch.backends.cuda.preferred_blas_library(backend)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    # the engine's attention launch beside an un-carved GEMM chain: session 5's baseline
    rows = {"engine_c0": pair_row(capture_graph(decode.engine(8)), carved_graph(gemms.run, 0),
                                  streams)}
    for c in carveouts:
        g_gemm = carved_graph(gemms.run, c)
        for programs in (k * c for k in per_sm):
            rows[f"c{c}_g{programs}"] = pair_row(capture_graph(attention(programs)), g_gemm,
                                                 streams)
    for name, r in rows.items():
        print(f"  together {backend} {name}: attention {r['attention_ms']:.2f} + gemm "
              f"{r['gemm_ms']:.2f}; together {r['together_ms']:.2f} (hidden {r['hidden']:.2f})",
              flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--carveouts", type=int, nargs="+", default=[0, 33, 50, 66, 88])
    parser.add_argument("--launch", type=int, nargs=3, default=[64, 4, 3],
                        metavar=("TILE_N", "WARPS", "STAGES"),
                        help="the persistent attention's launch shape in 'together'")
    parser.add_argument("--programs-per-sm", type=int, nargs="+", default=[1, 2],
                        help="in 'together': G = k x c attention programs for each k (c: the "
                             "SMs the GEMMs leave)")
    parser.add_argument("--backends", nargs="+", default=["cublas", "cublaslt"])
    parser.add_argument("--skip-attention-sweep", action="store_true")
    parser.add_argument("--prefetch-ids", action="store_true",
                        help="the persistent attention loads the next tile's block ids ahead")
    parser.add_argument("--tma", type=int, nargs=3, metavar=("WARPS", "STAGES", "BLOCKS"),
                        help="in 'together': decode_tma.py's attention at this launch instead")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    t0 = time.perf_counter()
    decode = DecodeBatch()
    report: dict = {"sms": sms, "kv_bytes": decode.kv_bytes}
    print(f"{sms} SMs; caches ready after {time.perf_counter() - t0:.1f} s", flush=True)
    def save() -> None:
        (args.out / "partition_probe.json").write_text(json.dumps(report, indent=1))
    if not args.skip_attention_sweep:
        report["attention"] = attention_rows(decode, sms, args.prefetch_ids)
        save()
    def attention(programs: int) -> Callable[[], None]:
        if args.tma:
            return decode.persistent_tma(programs, *args.tma)
        return decode.persistent(programs, *args.launch, args.prefetch_ids)

    for rows in args.rows:
        gemms = PrefillGemms(rows)
        report[f"gemm_p{rows}"] = gemm_rows(gemms, sms, args.carveouts)
        save()
        for backend in args.backends:
            report[f"together_p{rows}_{backend}"] = together_rows(
                decode, gemms, [c for c in args.carveouts if c], attention, backend,
                args.programs_per_sm)
            save()
        del gemms
    print(f"done after {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
