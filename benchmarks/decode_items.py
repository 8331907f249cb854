"""Pieces of the benchmarks' persistent decode kernels (``decode_batch.py``, ``decode_tma.py``):
the start of one (request, kv head) item (which request and kv head it is, its context, its
block-table row, its query rows and the empty online-softmax state) and an L2 prefetch of the
cache rows a later key tile will read."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def start_item(item, q_ptr, seq_lens_ptr, block_table_ptr, stride_bt,
               KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr):
    """(kv_head, seq_len, its cache blocks, block-table row pointer, q/out offsets
    [BLOCK_M, HEAD_DIM], q [BLOCK_M, HEAD_DIM] (rows past GROUP zero), acc, m_i, l_i) of
    ``item`` = req * KV_HEADS + kv_head; q and out are [num_reqs, KV_HEADS * GROUP, HEAD_DIM],
    contiguous. (The order of these lines is the one the kernels were timed with.)"""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    req = item // KV_HEADS
    kv_head = item % KV_HEADS
    seq_len = tl.load(seq_lens_ptr + req)
    num_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    head = kv_head * GROUP + offs_m
    off = (req.to(tl.int64) * GROUP * KV_HEADS + head[:, None]) * HEAD_DIM + offs_d[None, :]
    q = tl.load(q_ptr + off, mask=(offs_m < GROUP)[:, None], other=0.0)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    return kv_head, seq_len, num_blocks, bt_row, off, q, acc, m_i, l_i


@triton.jit
def prefetch_l2(ptrs):
    """``prefetch.global.L2`` of the 128-byte line at each pointer of ``ptrs`` (any shape): the
    L2 fetches it from HBM while the program goes on; nothing lands in registers or shared
    memory, so the bytes in flight are not bounded by the program's buffers."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_tile_l2(kc, vc, bt_row, start, seq_len, stride_block, stride_off,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, TILE_N: tl.constexpr):
    """L2 prefetch of the K and V rows (``HEAD_DIM`` bf16 values each, from ``kc`` / ``vc``) of
    the keys ``start .. start + TILE_N`` that lie before ``seq_len``; one prefetch per 128-byte
    line (64 bf16 values)."""
    LINES: tl.constexpr = HEAD_DIM // 64
    key_pos = start + tl.arange(0, TILE_N)
    ids = tl.load(bt_row + key_pos // BLOCK_SIZE, mask=key_pos < seq_len, other=0)
    # Keys past the context point at the null block 0's rows: harmless prefetches.
    row = ids.to(tl.int64) * stride_block + (key_pos % BLOCK_SIZE) * stride_off
    line = row[:, None] + (tl.arange(0, LINES) * 64)[None, :]  # [TILE_N, LINES]
    prefetch_l2(kc + line)
    prefetch_l2(vc + line)
