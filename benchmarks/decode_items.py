"""The start of one (request, kv head) item in the benchmarks' persistent decode kernels
(``decode_batch.py``, ``decode_tma.py``): which request and kv head it is, its context, its
block-table row, its query rows and the empty online-softmax state."""

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
