"""Can a decode attention program and a matmul program share one SM, each on its own stream?

    python benchmarks/coresidence_probe.py --out DIR     # on the GPU
    python benchmarks/coresidence_probe.py --ir          # anywhere: sm_90 shared memory only

Target 3 needs the decode attention (bandwidth-bound) to run under prefill matmuls
(compute-bound). Session 5 measured that cuBLAS GEMMs and our attention on two streams do not
overlap (each program wants most of an SM's shared memory, so a kernel of the other stream
waits for the first one's last wave), and sessions 6-10 that a third of the SMs cannot read
the KV cache fast enough for an SM partition (best 52 GB/s per SM, 97 needed). The route left:
both kernels on every SM at once, the matmul's tensor cores busy while the attention's loads
wait. That needs a matmul that holds one program per SM with shared memory to spare, and an
attention program that fits beside it.

Here a persistent Triton matmul (``persistent_matmul_kernel``: one program per SM, TMA loads
of ``BM x BK`` and ``BN x BK`` tiles, ``stages`` deep) runs a prefill-like GEMM (P tokens x
the gate/up projection, repeated to ~10 ms), and the batch-256 decode attention at context
1500 (``decode_batch.py``'s 32 layers, by ``decode_swapped.py``'s or ``decode_batch.py``'s
persistent kernel with G programs) beside it: each alone, one after the other on one stream,
and at once on two streams (each a CUDA graph, median of 15 replays). cuBLAS's time for the
same GEMMs is the reference the engine runs today. Writes DIR/coresidence_probe.json.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

REPS = 15
FFN2, HIDDEN = 2 * 14336, 4096  # the gate/up projection of Llama-3-8B: [FFN2, HIDDEN]
# (BM, BN, BK, stages, warps) of the matmul: shared memory (BM + BN) x BK x 2 B x stages
MATMULS = [(128, 128, 64, 3, 8), (128, 128, 64, 2, 8), (128, 256, 64, 2, 8)]
# (kernel, tile_n, warps, stages) of the attention; "swapped": decode_swapped.py, "rows":
# decode_batch.py (block ids a tile ahead)
ATTENTIONS = [("swapped", 64, 4, 3), ("swapped", 64, 4, 2), ("rows", 64, 4, 3),
              ("rows", 128, 4, 2)]


@triton.jit
def persistent_matmul_kernel(
    a_desc,  # over A [M, K]
    b_desc,  # over B [N, K]
    c_ptr,  # [M, N]
    M,
    N,
    K,
    num_m,  # cdiv(M, BM)
    num_n,  # cdiv(N, BN)
    num_tiles,  # num_m * num_n
    stride_cm,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,  # row tiles per group: tiles of a group share B's columns in L2
):
    """C = A @ B^T, bf16 in and out, fp32 accumulation; program p takes tiles p, p + G, ..."""
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        first_m = tile // (GROUP_M * num_n) * GROUP_M
        group_rows = min(num_m - first_m, GROUP_M)
        pm = first_m + tile % group_rows
        pn = tile % (GROUP_M * num_n) // group_rows
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k in range(0, K, BK):
            a = a_desc.load([pm * BM, k])  # [BM, BK]
            b = b_desc.load([pn * BN, k])  # [BN, BK]
            acc = tl.dot(a, tl.trans(b), acc)
        offs_m = pm * BM + tl.arange(0, BM)
        offs_n = pn * BN + tl.arange(0, BN)
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        c = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
        tl.store(c, acc.to(tl.bfloat16), mask=mask)


def matmul(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, programs: int,
           shape: tuple[int, int, int, int, int]) -> None:
    """c [M, N] = a [M, K] @ b [N, K]^T by ``programs`` persistent programs."""
    bm, bn, bk, stages, warps = shape
    num_m, num_n = triton.cdiv(a.shape[0], bm), triton.cdiv(b.shape[0], bn)
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(b, [bn, bk])
    persistent_matmul_kernel[(programs,)](
        a_desc, b_desc, c, a.shape[0], b.shape[0], a.shape[1], num_m, num_n, num_m * num_n,
        c.stride(0),
        BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def print_ir() -> None:
    """Shared memory of each matmul and attention launch, compiled for sm_90 (no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = persistent_matmul_kernel
    for bm, bn, bk, stages, warps in MATMULS:
        constexprs = dict(BM=bm, BN=bn, BK=bk, GROUP_M=8)
        sig = dict(a_desc=f"tensordesc<bf16[{bm}, {bk}]>", b_desc=f"tensordesc<bf16[{bn}, {bk}]>",
                   c_ptr="*bf16", M="i32", N="i32", K="i32", num_m="i32", num_n="i32", num_tiles="i32",
                   stride_cm="i32",
                   **{k: "constexpr" for k in constexprs})
        kernel = triton.compile(ASTSource(fn, sig, constexprs=constexprs),
                                target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=warps, num_stages=stages))
        print(f"matmul {bm}x{bn}x{bk} s{stages} w{warps}: shared {kernel.metadata.shared} B, "
              f"wgmma {kernel.asm['ptx'].count('wgmma.mma_async')}", flush=True)


def attention_run(batch, kind: str, tile_n: int, warps: int, stages: int,
                  programs: int) -> Callable[[], None]:
    from decode_batch import launch
    from decode_swapped import launch_swapped

    def run() -> None:
        for cache in batch.caches:
            if kind == "swapped":
                launch_swapped(batch.out, batch.q, cache, batch.block_table, batch.seq_lens,
                               programs, tile_n, warps, stages)
            else:
                launch(batch.out, batch.q, cache, batch.block_table, batch.seq_lens, programs,
                       tile_n, warps, stages, True)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--ir", action="store_true", help="print sm_90 shared memory and stop")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096],
                        help="the prefill GEMM's rows")
    args = parser.parse_args()
    if args.ir:
        print_ir()
        return
    from decode_batch import DecodeBatch
    from graph_timing import COPY_BANDWIDTH, MATMUL_PEAK, capture_graph, median_ms
    from overlap_probe import concurrently

    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = DecodeBatch()
    weight = torch.randn(FFN2, HIDDEN, dtype=torch.bfloat16, device="cuda") * 0.02
    report: dict = {"sms": sms, "kv_bytes": batch.kv_bytes, "rows": []}
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def timed(fn: Callable[[], object]) -> tuple[float, torch.cuda.CUDAGraph]:
        graph = capture_graph(fn)
        return median_ms(graph.replay, REPS), graph

    attentions = {}
    for kind, tile_n, warps, stages in ATTENTIONS:
        for programs in (sms, 2 * sms):
            name = f"{kind} t{tile_n} w{warps} s{stages} G={programs}"
            attentions[name] = timed(attention_run(batch, kind, tile_n, warps, stages, programs))
            ms = attentions[name][0]
            print(f"attention {name}: {ms:.2f} ms "
                  f"({batch.kv_bytes / ms / 1e-3 / COPY_BANDWIDTH:.2f} of copy bw)", flush=True)
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device="cuda")
        c = torch.empty(tokens, FFN2, dtype=torch.bfloat16, device="cuda")
        repeat = max(1, round(10e-3 * MATMUL_PEAK / (2 * tokens * FFN2 * HIDDEN)))
        flops = 2 * tokens * FFN2 * HIDDEN * repeat
        ref = F.linear(x, weight)
        cublas_ms, _ = timed(lambda x=x, repeat=repeat: [F.linear(x, weight)
                                                         for _ in range(repeat)])
        print(f"P={tokens} x{repeat}: cuBLAS {cublas_ms:.2f} ms "
              f"({flops / cublas_ms / 1e9:.0f} TFLOP/s)", flush=True)
        for shape in MATMULS:
            def gemm(shape=shape, x=x, c=c, repeat=repeat) -> None:
                for _ in range(repeat):
                    matmul(x, weight, c, sms, shape)
            try:
                gemm()
                err = (c.float() - ref.float()).abs().max().item()
                gemm_ms, g_gemm = timed(gemm)
            except Exception as e:  # noqa: BLE001 - a launch that does not fit shared memory
                print(f"  matmul {shape}: {e}"[:200], flush=True)
                continue
            print(f"  matmul {shape}: {gemm_ms:.2f} ms ({flops / gemm_ms / 1e9:.0f} TFLOP/s, "
                  f"err {err:.2g})", flush=True)
            for name, (attn_ms, g_attn) in attentions.items():
                serial = median_ms(lambda g_attn=g_attn, g_gemm=g_gemm: (g_gemm.replay(),
                                                                          g_attn.replay()), REPS)
                together = median_ms(concurrently([g_gemm, g_attn], streams), REPS)
                row = {"tokens": tokens, "repeat": repeat, "matmul": shape, "attention": name,
                       "cublas_ms": cublas_ms, "matmul_ms": gemm_ms, "attention_ms": attn_ms,
                       "serial_ms": serial, "together_ms": together,
                       "hidden_of_shorter": (serial - together) / min(gemm_ms, attn_ms)}
                report["rows"].append(row)
                print(f"    + {name}: alone {attn_ms:.2f}, serial {serial:.2f}, together "
                      f"{together:.2f} (hides {row['hidden_of_shorter']:.2f} of the shorter; "
                      f"cuBLAS + attention {cublas_ms + attn_ms:.2f})", flush=True)
            (args.out / "coresidence_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
