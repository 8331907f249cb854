"""A decode step's small kernels against hand-written replacements, and the card's read rate.

    python benchmarks/fusion_probe.py --out DIR [--rows 64 256 8192] [--skip-read]

Llama-3-8B shapes, bf16, each timed as the engine runs it (a CUDA graph of 10 calls, median of
15 replays; ``graph_timing.py``):

- SiLU-and-mul on the gate_up output ([rows, 28,672] -> [rows, 14,336]): the torch code of
  ``layers/activation.py`` compiled by Inductor (what the engine runs today) against
  ``kernels/silu_and_mul.py`` at several block sizes and warp counts;
- the rotary embedding of q and k plus the KV-cache write: Inductor's rotation (the model's
  ``RotaryEmbedding.rotate`` on the qkv output, compiled) followed by the engine's cache-write
  kernel before session 11 (kept here as ``old_write_kv``), against
  ``kernels/rope_kv_write.py`` doing both in one kernel;
- the card's read rate (unless ``--skip-read``): a Triton kernel summing a 4 GiB buffer with G
  programs, ``torch.sum`` and a device copy, to show how far a memory-bound kernel that only
  reads (decode attention) can go beyond the copy bandwidth the roofline uses.

Each replacement is checked against the torch code first (mismatching elements printed).
Writes ``fusion_probe.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from graph_timing import COPY_BANDWIDTH, graph_time_ms, median_ms

from pagedserve.kernels.rope_kv_write import rope_and_write_kv
from pagedserve.kernels.silu_and_mul import silu_and_mul
from pagedserve.layers.rotary import get_rope

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4096, 14336, 32, 8, 128, 16
CALLS = 10


@triton.jit
def _kv_write_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # int64 [>= num_tokens]
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_kc_block,
    stride_kc_off,
    stride_kc_head,
    stride_vc_block,
    stride_vc_off,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        # PAD_SLOT_ID: a padding row, nothing lands in the cache.
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, KV_HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)

    key = tl.load(key_ptr + token * stride_key_tok + heads * stride_key_head + dims, mask=mask)
    kc_row = key_cache_ptr + block * stride_kc_block + offset * stride_kc_off
    tl.store(kc_row + heads * stride_kc_head + dims, key, mask=mask)

    value_off = token * stride_value_tok + heads * stride_value_head + dims
    value = tl.load(value_ptr + value_off, mask=mask)
    vc_row = value_cache_ptr + block * stride_vc_block + offset * stride_vc_off
    tl.store(vc_row + heads * stride_vc_head + dims, value, mask=mask)


def old_write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """The engine's cache write before session 11 (``kernels/kv_write.py``, removed when the
    fused kernel took its place): key, value [T, Hkv, D] to their slots, one program per token."""
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _kv_write_kernel[(key.shape[0],)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=key.shape[1], HEAD_DIM=key.shape[2],
        KV_HEADS_PAD=triton.next_power_of_2(key.shape[1]),
        HEAD_DIM_PAD=triton.next_power_of_2(key.shape[2]), BLOCK_SIZE=kv_cache.shape[2],
    )  # fmt: skip


def per_call_us(fn) -> float:  # noqa: ANN001
    return graph_time_ms(lambda: [fn() for _ in range(CALLS)], 15) * 1000 / CALLS


def silu_rows(rows: int) -> dict:
    x = torch.randn(rows, 2 * FFN, dtype=torch.bfloat16, device="cuda")
    torch_code = torch.compile(lambda x: F.silu(x[:, :FFN]) * x[:, FFN:], dynamic=False)
    eager = F.silu(x[:, :FFN]) * x[:, FFN:]
    bytes_moved = rows * 3 * FFN * 2
    out = {"inductor": per_call_us(lambda: torch_code(x))}
    for block in (1024, 2048, 4096):
        for warps in (4, 8):
            got = silu_and_mul(x, block, warps)
            if (got != eager).any():
                print(f"silu block {block} warps {warps}: {(got != eager).sum().item()} differ")
            out[f"kernel_b{block}_w{warps}"] = per_call_us(lambda b=block, w=warps: silu_and_mul(x, b, w))
    report = {k: {"us": us, "of_copy_bw": bytes_moved / (us * 1e-6) / COPY_BANDWIDTH} for k, us in out.items()}
    print(f"silu_and_mul rows {rows}: " + ", ".join(f"{k} {v['us']:.2f} us ({v['of_copy_bw']:.2f})" for k, v in report.items()))
    return report


def rope_rows(rows: int) -> dict:
    rope = get_rope(HEAD_DIM, 8192, {"rope_type": "default", "rope_theta": 500000.0},
                    torch.bfloat16, torch.device("cuda"))  # fmt: skip
    positions = torch.randint(0, 8192, (rows,), device="cuda")
    cos_sin = rope.cos_sin(positions)  # [rows, head_dim]
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    num_blocks = rows // BLOCK_SIZE * 4 + 8
    cache = torch.zeros(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:rows].to(torch.int64)
    sizes = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]

    def split_rotate(qkv, cos_sin):  # noqa: ANN001, ANN202
        q, k, v = qkv.split(sizes, dim=-1)
        q, k = rope.rotate(cos_sin, q, k)
        return q, k, v

    compiled = torch.compile(split_rotate, dynamic=False)
    kv_shape = (rows, KV_HEADS, HEAD_DIM)

    def unfused() -> torch.Tensor:
        q, k, v = compiled(qkv, cos_sin)
        old_write_kv(k.view(kv_shape), v.view(kv_shape), cache, slots)
        return q

    def fused() -> torch.Tensor:
        q, k, v = qkv.split(sizes, dim=-1)
        return rope_and_write_kv(q, k, v, cos_sin, cache, slots)

    q_eager, _, _ = split_rotate(qkv, cos_sin)
    cache.zero_()
    q_unfused, ref_cache = unfused(), cache.clone()
    cache.zero_()
    q_fused = fused()
    print(f"rope rows {rows}: fused vs eager q differ {(q_fused != q_eager).sum().item()}, "
          f"Inductor vs eager q differ {(q_unfused != q_eager).sum().item()}, "
          f"fused vs Inductor cache max diff {(cache.float() - ref_cache.float()).abs().max().item():.3g}")  # fmt: skip
    bytes_moved = rows * (HEADS * 2 + KV_HEADS * 4 + 1) * HEAD_DIM * 2
    report = {}
    for name, fn in (("inductor_rotate_then_kv_write", unfused), ("fused_kernel", fused)):
        us = per_call_us(fn)
        report[name] = {"us": us, "of_copy_bw": bytes_moved / (us * 1e-6) / COPY_BANDWIDTH}
    print(f"rope + kv write rows {rows}: " + ", ".join(f"{k} {v['us']:.2f} us" for k, v in report.items()))
    return report


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, G: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, n, G * BLOCK):
        acc += tl.load(x_ptr + start + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def read_rates() -> dict:
    n = 1 << 31  # 4 GiB of bf16
    x = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    out = {}
    for per_sm in (1, 2, 4, 8):
        for block, warps in ((4096, 8), (8192, 8), (8192, 16)):
            g = per_sm * sm
            partial = torch.empty(g, dtype=torch.float32, device="cuda")
            ms = median_ms(lambda g=g, p=partial, b=block, w=warps: _read_kernel[(g,)](x, p, n, G=g, BLOCK=b, num_warps=w), 10)
            out[f"triton_read_{per_sm}per_sm_b{block}_w{warps}"] = 2 * n / (ms * 1e-3)
    out["torch_sum"] = 2 * n / (median_ms(lambda: x.sum(dtype=torch.float32), 10) * 1e-3)
    half = x[: n // 2]
    dst = torch.empty_like(half)
    out["copy_read_plus_write"] = 2 * 2 * (n // 2) / (median_ms(lambda: dst.copy_(half), 10) * 1e-3)
    for name, rate in out.items():
        print(f"read {name}: {rate / 1e12:.3f} TB/s ({rate / COPY_BANDWIDTH:.3f} of the 4.25 copy)")
    return {k: {"bytes_per_s": v, "of_copy_bw": v / COPY_BANDWIDTH} for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256, 8192])
    parser.add_argument("--skip-read", action="store_true")
    args = parser.parse_args()
    result = {"silu_and_mul": {}, "rope_kv_write": {}}
    for rows in args.rows:
        result["silu_and_mul"][rows] = silu_rows(rows)
        result["rope_kv_write"][rows] = rope_rows(rows)
    if not args.skip_read:
        result["read_rates"] = read_rates()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fusion_probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
