"""A persistent decode attention whose K/V reads are TMA (bulk tensor) copies of whole cache blocks.

The question it answers for target 3 (BENCHMARKS.md, sessions 6-8): can one SM read the KV cache
at ~100 GB/s, so that a third of the SMs read it at the card's bandwidth while the GEMMs hold the
rest? ``decode_batch.py``'s kernel gathers each K/V tile with per-thread loads and reads at most
~32 GB/s per program at any depth or warp count. Here each (request, kv head) item walks its
cache blocks, ``BLOCKS_PER_ITER`` per iteration (unrolled, one online-softmax update per block):
the block ids of the *next* iteration are loaded ahead (loop-carried), and each block's 16 keys
x 128 dims of K and of V arrive as two 4 KB ``TensorDescriptor`` loads, which Triton's pipeliner
keeps ``num_stages - 1`` iterations ahead on Hopper (one thread issues each copy; the bytes land
in shared memory without the warps' load instructions). So a program keeps ~(stages - 1) x
BLOCKS_PER_ITER x 8 KB in flight, and several programs share an SM.

A partial last block masks its scores; its unused rows are read (finite in this probe's cache,
whose every slot is written; the engine's cache can hold garbage there, so an engine version
would also zero ``p`` for those rows, as it does). ``launch_tma`` takes the same arguments as
``decode_batch.launch``; ``decode_depth_probe.py --tma`` times it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from decode_items import start_item
from triton.tools.tensor_descriptor import TensorDescriptor

from pagedserve.kernels.attention_common import LOG2_E


@triton.jit
def persistent_decode_tma_kernel(
    out_ptr,  # [num_reqs, HEADS, HEAD_DIM]
    q_ptr,  # [num_reqs, HEADS, HEAD_DIM]
    k_desc,  # over the key cache as [num_blocks * BLOCK_SIZE, KV_HEADS * HEAD_DIM]
    v_desc,  # the same over the value cache
    block_table_ptr,  # int32 [num_reqs, max_blocks]
    seq_lens_ptr,  # int32 [num_reqs]
    num_items,  # num_reqs * KV_HEADS
    qk_scale,
    stride_bt,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # q heads of one kv head, padded to 16 for tl.dot
    BLOCKS_PER_ITER: tl.constexpr,  # cache blocks per loop iteration (unrolled)
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_b = tl.arange(0, BLOCKS_PER_ITER)
    offs_n = tl.arange(0, BLOCK_SIZE)
    row_mask = offs_m < GROUP
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        kv_head, seq_len, num_blocks, bt_row, off, q, acc, m_i, l_i = start_item(
            item, q_ptr, seq_lens_ptr, block_table_ptr, stride_bt, KV_HEADS, GROUP, HEAD_DIM,
            BLOCK_SIZE, BLOCK_M)
        col = kv_head * HEAD_DIM
        ids = tl.load(bt_row + offs_b, mask=offs_b < num_blocks, other=0)
        for it in range(0, tl.cdiv(num_blocks, BLOCKS_PER_ITER)):
            current = ids
            nxt = (it + 1) * BLOCKS_PER_ITER + offs_b
            ids = tl.load(bt_row + nxt, mask=nxt < num_blocks, other=0)  # next iteration's
            for j in tl.static_range(BLOCKS_PER_ITER):
                row = tl.sum(tl.where(offs_b == j, current, 0)) * BLOCK_SIZE
                k = k_desc.load([row, col])  # [BLOCK_SIZE, HEAD_DIM]
                # A block past the request's last (id 0, the null block) is all masked.
                key_mask = (it * BLOCKS_PER_ITER + j) * BLOCK_SIZE + offs_n < seq_len
                s = tl.dot(q, tl.trans(k)) * qk_scale
                s = tl.where(key_mask[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                p = tl.exp2(s - m_new[:, None])
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = v_desc.load([row, col])  # [BLOCK_SIZE, HEAD_DIM]
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
        tl.store(out_ptr + off, acc / l_i[:, None], mask=row_mask[:, None])


def cache_descriptors(cache: torch.Tensor) -> tuple[TensorDescriptor, TensorDescriptor]:
    """K and V descriptors of ``cache`` [2, num_blocks, block_size, kv_heads, head_dim]
    (contiguous): 2D views [num_blocks * block_size, kv_heads * head_dim], one cache block of
    one kv head ([block_size, head_dim]) per load."""
    _, num_blocks, block_size, kv_heads, head_dim = cache.shape
    views = [cache[i].view(num_blocks * block_size, kv_heads * head_dim) for i in (0, 1)]
    k, v = (TensorDescriptor.from_tensor(x, [block_size, head_dim]) for x in views)
    return k, v


def launch_tma(out: torch.Tensor, q: torch.Tensor, cache: torch.Tensor,
               block_table: torch.Tensor, seq_lens: torch.Tensor, programs: int, warps: int,
               stages: int, blocks_per_iter: int = 1,
               descriptors: tuple[TensorDescriptor, TensorDescriptor] | None = None) -> None:
    """``persistent_decode_tma_kernel`` with ``programs`` programs: q and out
    [num_reqs, heads, head_dim]; ``descriptors`` from ``cache_descriptors(cache)`` (built here
    if not given: the host work of a launch)."""
    k_desc, v_desc = descriptors or cache_descriptors(cache)
    kv_heads, head_dim, block_size = cache.shape[3], cache.shape[4], cache.shape[2]
    num_items = q.shape[0] * kv_heads
    persistent_decode_tma_kernel[(min(programs, num_items),)](
        out, q, k_desc, v_desc, block_table, seq_lens, num_items, head_dim**-0.5 * LOG2_E,
        block_table.stride(0), KV_HEADS=kv_heads, GROUP=q.shape[1] // kv_heads,
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=16, BLOCKS_PER_ITER=blocks_per_iter,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
