"""A persistent decode attention with the dots swapped: keys as the rows of the tensor-core tile.

The question it answers for target 3 (BENCHMARKS.md, sessions 6-10): what bounds one decode
program's read rate? ``decode_batch.py``'s kernel computes ``q @ k^T`` with the 4 query heads of
a kv head padded to 16 rows (``mma.sync`` tiles, three quarters of the math on padding) and
reads 22-25 GB/s per program whatever it keeps in flight (session 10: L2 prefetches several
tiles ahead changed nothing, so not the memory latency). Here each tile computes
``s^T = k @ q^T`` ([TILE_N keys, 16 heads]) and ``acc^T += v^T @ p^T`` ([HEAD_DIM, 16]): the
keys and the head dimension are the M side, a multiple of 64, so Hopper's ``wgmma`` takes the
K/V tiles straight from shared memory; the softmax runs along axis 0. ``launch_swapped`` takes
``decode_batch.launch``'s arguments less ``prefetch`` / ``block_m`` (block ids are always loaded
one tile ahead); ``decode_depth_probe.py --swapped`` times it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from decode_batch import launch_gathered
from decode_items import start_item

HEADS_PAD = 16  # the query heads of one kv head, padded for tl.dot's N side


@triton.jit
def persistent_decode_swapped_kernel(
    out_ptr,  # [num_reqs, HEADS, HEAD_DIM]
    q_ptr,  # [num_reqs, HEADS, HEAD_DIM]
    key_cache_ptr,  # [num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM]
    value_cache_ptr,  # [num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM]
    block_table_ptr,  # int32 [num_reqs, max_blocks]
    seq_lens_ptr,  # int32 [num_reqs]
    num_items,  # num_reqs * KV_HEADS
    qk_scale,
    stride_block,
    stride_off,
    stride_bt,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,  # keys per tile: the dots' M side, a multiple of 64
    BLOCK_M: tl.constexpr,  # q heads of one kv head, padded: the dots' N side
):
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, TILE_N)
    row_mask = tl.arange(0, BLOCK_M) < GROUP
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        kv_head, seq_len, _, bt_row, off, q, acc, m_i, l_i = start_item(
            item, q_ptr, seq_lens_ptr, block_table_ptr, stride_bt, KV_HEADS, GROUP, HEAD_DIM,
            BLOCK_SIZE, BLOCK_M)
        q_t = tl.trans(q)  # [HEAD_DIM, BLOCK_M]
        acc_t = tl.trans(acc)  # [HEAD_DIM, BLOCK_M], fp32 zeros
        kc = key_cache_ptr + kv_head * HEAD_DIM
        vc = value_cache_ptr + kv_head * HEAD_DIM
        ids = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=offs_n < seq_len, other=0)
        for start in range(0, seq_len, TILE_N):
            key_pos = start + offs_n
            key_mask = key_pos < seq_len
            row = ids.to(tl.int64) * stride_block + (key_pos % BLOCK_SIZE) * stride_off
            nxt = key_pos + TILE_N
            ids = tl.load(bt_row + nxt // BLOCK_SIZE, mask=nxt < seq_len, other=0)
            k = tl.load(kc + row[:, None] + offs_d[None, :], mask=key_mask[:, None], other=0.0)
            s_t = tl.dot(k, q_t) * qk_scale  # [TILE_N, BLOCK_M]
            s_t = tl.where(key_mask[:, None], s_t, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s_t, 0))
            p_t = tl.exp2(s_t - m_new[None, :])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p_t, 0)
            v = tl.load(vc + row[:, None] + offs_d[None, :], mask=key_mask[:, None], other=0.0)
            acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(v), p_t.to(v.dtype))
            m_i = m_new
        out = tl.trans(acc_t) / l_i[:, None]  # [BLOCK_M, HEAD_DIM]
        tl.store(out_ptr + off, out, mask=row_mask[:, None])


def launch_swapped(out: torch.Tensor, q: torch.Tensor, cache: torch.Tensor,
                   block_table: torch.Tensor, seq_lens: torch.Tensor, programs: int,
                   tile_n: int, warps: int, stages: int) -> None:
    """``persistent_decode_swapped_kernel`` with ``programs`` programs: q and out
    [num_reqs, heads, head_dim], cache [2, num_blocks, block_size, kv_heads, head_dim], all
    contiguous."""
    launch_gathered(persistent_decode_swapped_kernel, out, q, cache, block_table, seq_lens,
                    programs, warps, stages, TILE_N=tile_n, BLOCK_M=HEADS_PAD)
