"""Can a prefill chunk's matmuls hide a decode batch's attention? Timed on the layer stack alone.

    python benchmarks/overlap_probe.py --out DIR

Llama-3-8B shape, bf16, 32 layers of random weights (the LM head, norms and rotary are left out:
they are the same in every variant). Two pieces of work per step:
  D: a decode batch of 256 requests at context 1500 (the middle of target 3's decode): per layer
     QKV / o_proj / gate-up / down GEMMs at M=256 and the paged decode attention (50 GB of KV
     read per step, bandwidth-bound);
  P: a prefill chunk of P tokens (one request, causal attention over the chunk): the same
     GEMMs at M=P (compute-bound above a few hundred tokens).
Each is captured as its own CUDA graph, and timed (median of 15 replays) alone, one after the
other on one stream, "joint" (one GEMM over the 256 + P rows per layer, the two attentions in
turn: what a mixed step runs today), and at once on two streams (fork/join around the two
replays; with each stream's priority as given). With ``--green N ...`` instead: P confined to a
CUDA green context of N SMs (graph replayed there, and launched eagerly there) beside D on the
whole card. With ``--partition C:G ...`` also: P's GEMMs on cuBLASLt told to leave C SMs free
and D's attention by a persistent kernel of G programs (decode_batch.py), at once on two
streams: the engine step an SM partition would run, against "joint" (``--partition-tma W S B``:
D's attention by decode_tma.py's kernel instead; ``--l2-ahead N``: decode_batch.py's with L2
prefetches N tiles ahead; ``--block-size`` sets the cache's tokens per
block, 16 by default). With ``--lockstep C:G ...``: D and P in lockstep layer by layer (P's
whole layer on a second stream beside D's attention, joined before D's o_proj; P's GEMMs
leaving C SMs, D's attention persistent on G programs), the step a prefill-beside-decode
engine would run. Writes
``overlap_probe.json``; results and what they mean: BENCHMARKS.md, sessions 5 and 6.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from decode_batch import (
    BLOCK,
    DECODE_BATCH,
    DECODE_CONTEXT,
    FFN,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    LAYERS,
    QKV,
    DecodeBatch,
)
from decode_batch import launch as persistent_decode
from decode_tma import launch_tma
from graph_timing import capture_graph, carved_graph, median_ms, sm_carveout

from pagedserve.kernels.paged_attention import DEFAULT_LAUNCH, KeyLoopLaunch, paged_attention

REPS = 15  # graph replays per timing (median)
LayerLaunch = Callable[[torch.Tensor, torch.Tensor, int], None]
"""(out, q [DECODE_BATCH, HEADS, HEAD_DIM], layer) -> None: one layer's decode attention."""


def layer_weights() -> list[tuple[torch.Tensor, ...]]:
    """Random bf16 (qkv, o, gate_up, down) weights of the 32 layers, [out, in] each."""
    def w(n: int, k: int) -> torch.Tensor:
        return torch.empty(n, k, dtype=torch.bfloat16, device="cuda").uniform_(-0.02, 0.02)
    return [(w(QKV, HIDDEN), w(HIDDEN, HEADS * HEAD_DIM), w(2 * FFN, HIDDEN), w(HIDDEN, FFN))
            for _ in range(LAYERS)]


class Stack:
    """Weights and KV caches of the 32 layers, and the per-branch attention inputs."""

    def __init__(self, decode_launch: KeyLoopLaunch, block_size: int = BLOCK) -> None:
        self.layers = layer_weights()
        self.decode = DecodeBatch(block_size)
        self.block_size = block_size
        self.caches = self.decode.caches  # the prefill chunk's keys go to blocks 1.. of them
        self.decode_meta = dict(
            block_table=self.decode.block_table, query_start_loc=self.decode.query_start_loc,
            seq_lens=self.decode.seq_lens, num_reqs=DECODE_BATCH, max_query_len=1,
            launch=decode_launch)

    def prefill_meta(self, tokens: int) -> dict:
        dev = "cuda"
        table = torch.arange(1, tokens // self.block_size + 2, dtype=torch.int32, device=dev)[None]
        return dict(block_table=table,
                    query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=dev),
                    seq_lens=torch.tensor([tokens], dtype=torch.int32, device=dev),
                    num_reqs=1, max_query_len=tokens)

    def attention(self, qkv: torch.Tensor, layer: int, meta: dict) -> torch.Tensor:
        m = qkv.shape[0]
        q = qkv[:, : HEADS * HEAD_DIM].view(m, HEADS, HEAD_DIM)
        out = torch.empty(m, HEADS, HEAD_DIM, dtype=qkv.dtype, device=qkv.device)
        paged_attention(q, self.caches[layer], meta["block_table"], meta["query_start_loc"],
                        meta["seq_lens"], meta["num_reqs"], m, meta["max_query_len"],
                        HEAD_DIM**-0.5, out, meta.get("launch", DEFAULT_LAUNCH))
        return out.view(m, HEADS * HEAD_DIM)

    def mlp(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        gate_up = F.linear(x, self.layers[layer][2])
        return F.linear(F.silu(gate_up[:, :FFN]) * gate_up[:, FFN:], self.layers[layer][3])

    def branch(self, x: torch.Tensor, meta: dict) -> Callable[[], torch.Tensor]:
        return self.chain(x, lambda qkv, layer: self.attention(qkv, layer, meta))

    def persistent_branch(self, x: torch.Tensor, launch_layer: LayerLaunch):
        """The decode batch with its attention by a persistent kernel: ``launch_layer(out, q,
        layer)`` (G programs, so it holds at most G SMs)."""
        def attend(qkv: torch.Tensor, layer: int) -> torch.Tensor:
            m = qkv.shape[0]
            q = qkv[:, : HEADS * HEAD_DIM].reshape(m, HEADS, HEAD_DIM).contiguous()
            out = torch.empty_like(q)  # [m, HEADS, HEAD_DIM]
            launch_layer(out, q, layer)
            return out.view(m, HEADS * HEAD_DIM)
        return self.chain(x, attend)

    def persistent_launch(self, programs: int, args: argparse.Namespace) -> LayerLaunch:
        """The persistent decode attention ``args`` ask for, with ``programs`` programs:
        ``decode_tma.py``'s with ``--partition-tma``, else ``decode_batch.launch``'s."""
        decode, caches = self.decode, self.caches
        if args.partition_tma:
            warps, stages, blocks = args.partition_tma
            descriptors = decode.descriptors()
            return lambda out, q, layer: launch_tma(
                out, q, caches[layer], decode.block_table, decode.seq_lens, programs, warps,
                stages, blocks, descriptors[layer])
        return lambda out, q, layer: persistent_decode(
            out, q, caches[layer], decode.block_table, decode.seq_lens, programs,
            *args.partition_launch, args.prefetch_ids, 16, args.l2_ahead)

    def chain(self, x: torch.Tensor, attend: Callable[[torch.Tensor, int], torch.Tensor]):
        def run() -> torch.Tensor:
            h = x
            for layer, (w_qkv, w_o, _, _) in enumerate(self.layers):
                h = h + F.linear(attend(F.linear(h, w_qkv), layer), w_o)
                h = h + self.mlp(h, layer)
            return h
        return run

    def joint(self, x: torch.Tensor, prefill: dict) -> Callable[[], torch.Tensor]:
        """One GEMM over decode + prefill rows, the two attentions one after the other."""
        def run() -> torch.Tensor:
            h = x
            for layer, (w_qkv, w_o, _, _) in enumerate(self.layers):
                qkv = F.linear(h, w_qkv)
                attn = torch.cat([self.attention(qkv[:DECODE_BATCH], layer, self.decode_meta),
                                  self.attention(qkv[DECODE_BATCH:], layer, prefill)])
                h = h + F.linear(attn, w_o)
                h = h + self.mlp(h, layer)
            return h
        return run


def lockstep(stack: Stack, x_d: torch.Tensor, x_p: torch.Tensor, prefill: dict,
             attend_decode: Callable[[torch.Tensor, int], torch.Tensor], carveout: int):
    """One step of the decode batch D and a prefill chunk P in lockstep, layer by layer: D's
    QKV GEMM on the whole card; then, at once on two streams, D's attention
    (``attend_decode``) and all of P's layer (its GEMMs on cuBLASLt leaving ``carveout`` SMs,
    0: cuBLAS's default path on every SM); both joined before D's o_proj and MLP on the whole
    card. So P's GEMMs run only inside D's attention windows, where the SMs' tensor cores
    would idle, and D's GEMMs run alone."""
    side_d, side_p = torch.cuda.Stream(), torch.cuda.Stream()

    def prefill_layer(g: torch.Tensor, layer: int) -> torch.Tensor:
        w_qkv, w_o, _, _ = stack.layers[layer]
        g = g + F.linear(stack.attention(F.linear(g, w_qkv), layer, prefill), w_o)
        return g + stack.mlp(g, layer)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        h, g = x_d, x_p
        main = torch.cuda.current_stream()
        for layer, (w_qkv, w_o, _, _) in enumerate(stack.layers):
            qkv = F.linear(h, w_qkv)
            side_d.wait_stream(main)
            side_p.wait_stream(main)
            with torch.cuda.stream(side_d):
                attn = attend_decode(qkv, layer)
            with torch.cuda.stream(side_p), carved_gemms(carveout):
                g = prefill_layer(g, layer)
            main.wait_stream(side_d)
            main.wait_stream(side_p)
            h = h + F.linear(attn, w_o)
            h = h + stack.mlp(h, layer)
        return h, g
    return run


@contextmanager
def carved_gemms(carveout: int) -> Iterator[None]:
    """GEMMs launched inside run on cuBLASLt, told to leave ``carveout`` SMs free (0: as is)."""
    if not carveout:
        yield
        return
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        with sm_carveout(carveout):
            yield
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")


def lockstep_rows(stack: Stack, x_decode: torch.Tensor, tokens: int, pairs: list[str],
                  args: argparse.Namespace) -> dict:
    """For each "C:G" of ``--lockstep``: ``lockstep`` with P's GEMMs leaving C SMs and D's
    attention by a persistent kernel of G programs (G = 0: the engine's split-KV launch on
    every SM). Also P's 32 layers alone with that carveout, and D alone with that attention."""
    meta = stack.prefill_meta(tokens)
    x_p = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device="cuda") * 0.1
    rows = {}
    for pair in pairs:
        carveout, programs = (int(v) for v in pair.split(":"))

        def attend(qkv: torch.Tensor, layer: int, programs: int = programs) -> torch.Tensor:
            m = qkv.shape[0]
            if programs == 0:
                return stack.attention(qkv, layer, stack.decode_meta)
            q = qkv[:, : HEADS * HEAD_DIM].reshape(m, HEADS, HEAD_DIM).contiguous()
            out = torch.empty_like(q)  # [m, HEADS, HEAD_DIM]
            stack.persistent_launch(programs, args)(out, q, layer)
            return out.view(m, HEADS * HEAD_DIM)

        with carved_gemms(carveout):
            g_p = capture_graph(stack.branch(x_p, meta))
        row = {"prefill_alone_ms": median_ms(g_p.replay, REPS),
               "decode_alone_ms": median_ms(capture_graph(stack.chain(x_decode, attend)).replay,
                                            REPS),
               "lockstep_ms": median_ms(capture_graph(
                   lockstep(stack, x_decode, x_p, meta, attend, carveout)).replay, REPS)}
        rows[pair] = row
        print(f"  P={tokens} lockstep carveout {carveout}, attention programs {programs or 'engine'}: "
              + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    return rows


def concurrently(graphs: list[torch.cuda.CUDAGraph], streams: list[torch.cuda.Stream]):
    return lambda: fork_join([(s, g.replay) for g, s in zip(graphs, streams, strict=True)])


_GREEN_CONTEXTS: list = []


def green_stream(num_sms: int) -> torch.cuda.Stream:
    """A stream whose kernels may use only ``num_sms`` SMs (a CUDA green context)."""
    from torch.cuda.green_contexts import GreenContext
    ctx = GreenContext.create(num_sms=num_sms, device_id=0)
    _GREEN_CONTEXTS.append(ctx)  # a collected context takes its streams with it
    return ctx.Stream()  # torch >= 2.11


def green_rows(stack: Stack, g_decode, tokens: int, splits: list[int]) -> dict:
    """The prefill chunk confined to a green context of n SMs, the decode graph on the rest."""
    meta = stack.prefill_meta(tokens)
    x_p = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device="cuda") * 0.1
    run_p = stack.branch(x_p, meta)
    g_p = capture_graph(run_p)
    rows = {"prefill_alone_ms": median_ms(g_p.replay, REPS),
            "one_after_other_ms": median_ms(lambda: (g_decode.replay(), g_p.replay()), REPS)}
    plain = torch.cuda.Stream()
    for n in splits:
        green = green_stream(n)
        variants = {
            "prefill_eager": [(green, run_p)],
            "prefill_graph": [(green, g_p.replay)],
            "both_graph": [(plain, g_decode.replay), (green, g_p.replay)],
            "both_eager": [(plain, g_decode.replay), (green, run_p)],
        }
        for name, parts in variants.items():
            try:
                rows[f"{name}_{n}sms_ms"] = median_ms(lambda parts=parts: fork_join(parts), REPS)
            except Exception as e:  # noqa: BLE001 - an API the installed torch lacks
                rows[f"{name}_{n}sms_error"] = str(e)[:200]
        print(f"  P={tokens} n={n}: " + ", ".join(f"{k} {v}" for k, v in rows.items()
                                                  if f"_{n}sms" in k or "_sms" not in k),
              flush=True)
    return rows


def partition_rows(stack: Stack, x_decode: torch.Tensor, tokens: int, pairs: list[str],
                   args: argparse.Namespace) -> dict:
    """For each "C:G": the prefill chunk's GEMMs on cuBLASLt told to leave C SMs (carveout),
    the decode batch's attention by a persistent kernel of G programs; each alone, then both
    at once on two streams."""
    torch.backends.cuda.preferred_blas_library("cublaslt")
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    meta = stack.prefill_meta(tokens)
    x_p = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device="cuda") * 0.1
    rows = {}
    for pair in pairs:
        carveout, programs = (int(v) for v in pair.split(":"))
        g_p = carved_graph(stack.branch(x_p, meta), carveout)
        g_d = capture_graph(stack.persistent_branch(x_decode,
                                                    stack.persistent_launch(programs, args)))
        row = {"decode_ms": median_ms(g_d.replay, REPS), "prefill_ms": median_ms(g_p.replay, REPS),
               "together_ms": median_ms(concurrently([g_d, g_p], streams), REPS)}
        rows[pair] = row
        print(f"  P={tokens} carveout {carveout}, {programs} attention programs: decode "
              f"{row['decode_ms']:.2f} + prefill {row['prefill_ms']:.2f}; together "
              f"{row['together_ms']:.2f}", flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    return rows


def fork_join(parts: list[tuple[torch.cuda.Stream, Callable[[], object]]]) -> None:
    """Each part on its stream, all after the current stream's work; the current stream
    then waits for all of them."""
    main = torch.cuda.current_stream()
    for stream, fn in parts:
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            fn()
    for stream, _ in parts:
        main.wait_stream(stream)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prefill", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--decode-launch", type=int, nargs=3, metavar=("TILE_N", "WARPS", "STAGES"),
                        help="the decode attention's launch shape (default: the engine's); a "
                             "small one (e.g. 32 4 1) may share an SM with a GEMM tile")
    parser.add_argument("--green", type=int, nargs="*", default=[],
                        help="SM counts for the prefill chunk's green context (skips the rest)")
    parser.add_argument("--partition", nargs="*", default=[], metavar="C:G",
                        help="also: prefill GEMMs leaving C SMs (cuBLASLt carveout) beside a "
                             "persistent decode attention of G programs")
    parser.add_argument("--lockstep", nargs="*", default=[], metavar="C:G",
                        help="also: D and P in lockstep per layer (P's layer beside D's "
                             "attention), P's GEMMs leaving C SMs, D's attention persistent "
                             "on G programs (0: the engine's launch)")
    parser.add_argument("--skip-streams", action="store_true",
                        help="time only P alone and joint besides the --partition/--lockstep rows")
    parser.add_argument("--partition-launch", type=int, nargs=3, default=[64, 4, 3],
                        metavar=("TILE_N", "WARPS", "STAGES"))
    parser.add_argument("--prefetch-ids", action="store_true",
                        help="the persistent attention loads the next tile's block ids ahead")
    parser.add_argument("--partition-tma", type=int, nargs=3, metavar=("WARPS", "STAGES", "BLOCKS"),
                        help="the persistent attention of decode_tma.py at this launch instead")
    parser.add_argument("--l2-ahead", type=int, default=0, metavar="N",
                        help="with --partition: the persistent attention prefetches the K/V "
                             "lines of the tile N tiles ahead to L2 (decode_batch.py)")
    parser.add_argument("--block-size", type=int, default=BLOCK,
                        help="tokens per KV cache block (decode_tma.py copies one per TMA load)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    stack = Stack(KeyLoopLaunch(*args.decode_launch) if args.decode_launch else DEFAULT_LAUNCH,
                  args.block_size)
    print(f"weights and caches ready after {time.perf_counter() - t0:.1f} s", flush=True)
    x_decode = torch.randn(DECODE_BATCH, HIDDEN, dtype=torch.bfloat16, device="cuda") * 0.1
    g_decode = capture_graph(stack.branch(x_decode, stack.decode_meta))
    d_ms = median_ms(g_decode.replay, REPS)
    report = {"decode_alone_ms": d_ms, "prefill": {}}
    print(f"decode b{DECODE_BATCH} ctx{DECODE_CONTEXT}: {d_ms:.2f} ms "
          f"(at {time.perf_counter() - t0:.1f} s)", flush=True)
    if args.green:
        for tokens in args.prefill:
            report["prefill"][tokens] = green_rows(stack, g_decode, tokens, args.green)
            (args.out / "overlap_probe.json").write_text(json.dumps(report, indent=1))
        return
    normal = [torch.cuda.Stream(), torch.cuda.Stream()]
    d_high = [torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=0)]
    p_high = [torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-1)]
    for tokens in args.prefill:
        meta = stack.prefill_meta(tokens)
        x_p = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device="cuda") * 0.1
        g_p = capture_graph(stack.branch(x_p, meta))
        g_joint = capture_graph(stack.joint(torch.cat([x_decode, x_p]), meta))
        row = {
            "prefill_alone_ms": median_ms(g_p.replay, REPS),
            "one_after_other_ms": median_ms(lambda g=g_p: (g_decode.replay(), g.replay()), REPS),
            "joint_ms": median_ms(g_joint.replay, REPS),
        }
        if not args.skip_streams:
            row["two_streams_ms"] = median_ms(concurrently([g_decode, g_p], normal), REPS)
            row["two_streams_decode_high_ms"] = median_ms(concurrently([g_decode, g_p], d_high),
                                                          REPS)
            row["two_streams_prefill_high_ms"] = median_ms(concurrently([g_decode, g_p], p_high),
                                                           REPS)
        print(f"P={tokens}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
        if args.partition:
            row["partition"] = partition_rows(stack, x_decode, tokens, args.partition, args)
        if args.lockstep:
            row["lockstep"] = lockstep_rows(stack, x_decode, tokens, args.lockstep, args)
        report["prefill"][tokens] = row
        (args.out / "overlap_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
