"""The Llama-3-8B decode batch the overlap probes share, and a persistent decode attention.

``DecodeBatch``: 256 requests at context 1500 (the middle of target 3's decode), 32 layers of
bf16 paged KV cache (block size 16 unless given, shuffled blocks: 50.3 GB), one query row per request.
``launch``: decode attention by a *persistent* kernel of G programs, each looping over
(request, kv head) items, so it holds at most G SMs; its key loop loads the block ids in the
iteration (as the engine's kernels do) or, with ``prefetch``, one tile ahead;
``persistent_tma``: the same loop with TMA copies of whole cache blocks (``decode_tma.py``).
Used by overlap_probe.py, partition_probe.py and decode_depth_probe.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from decode_items import prefetch_tile_l2, start_item
from decode_tma import cache_descriptors, launch_tma

from pagedserve.attention.backends.triton import SPLIT_KV_LAUNCH
from pagedserve.kernels.attention_common import LOG2_E
from pagedserve.kernels.paged_attention_split import paged_attention_split_kv

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, BLOCK = 32, 4096, 32, 8, 128, 14336, 16
QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM
DECODE_BATCH, DECODE_CONTEXT = 256, 1500


class DecodeBatch:
    """The decode batch's 32 layers of KV cache, its block table and its query and output."""

    def __init__(self, block_size: int = BLOCK) -> None:
        dev, dt = "cuda", torch.bfloat16
        blocks_per_req = DECODE_CONTEXT // block_size + 1
        num_blocks = DECODE_BATCH * blocks_per_req + 1
        self.caches = [torch.empty(2, num_blocks, block_size, KV_HEADS, HEAD_DIM, dtype=dt,
                                   device=dev).uniform_(-1, 1) for _ in range(LAYERS)]
        perm = torch.randperm(num_blocks - 1, device=dev) + 1
        # int32 [DECODE_BATCH, blocks_per_req]
        self.block_table = perm[: DECODE_BATCH * blocks_per_req].view(DECODE_BATCH, -1).int()
        self.seq_lens = torch.full((DECODE_BATCH,), DECODE_CONTEXT, dtype=torch.int32,
                                   device=dev)
        self.query_start_loc = torch.arange(DECODE_BATCH + 1, dtype=torch.int32, device=dev)
        self.q = torch.randn(DECODE_BATCH, HEADS, HEAD_DIM, dtype=dt, device=dev)
        self.out = torch.empty_like(self.q)  # [DECODE_BATCH, HEADS, HEAD_DIM]
        self.kv_bytes = LAYERS * DECODE_BATCH * DECODE_CONTEXT * KV_HEADS * HEAD_DIM * 2 * 2
        self._descriptors: list | None = None  # TMA descriptors of the caches, on first use

    def persistent(self, programs: int, tile_n: int, warps: int, stages: int,
                   prefetch: bool, block_m: int = 16, l2_ahead: int = 0) -> Callable[[], None]:
        """The 32 layers' attention by ``launch`` (``out`` holds the last layer's)."""
        def run() -> None:
            for cache in self.caches:
                launch(self.out, self.q, cache, self.block_table, self.seq_lens, programs,
                       tile_n, warps, stages, prefetch, block_m, l2_ahead)
        return run

    def descriptors(self) -> list:
        """Each layer's (K, V) TMA descriptors (``decode_tma.cache_descriptors``), built once."""
        if self._descriptors is None:
            self._descriptors = [cache_descriptors(cache) for cache in self.caches]
        return self._descriptors

    def persistent_tma(self, programs: int, warps: int, stages: int,
                       blocks_per_iter: int) -> Callable[[], None]:
        """The 32 layers' attention by ``decode_tma.launch_tma``."""
        descriptors = self.descriptors()

        def run() -> None:
            for cache, d in zip(self.caches, descriptors, strict=True):
                launch_tma(self.out, self.q, cache, self.block_table, self.seq_lens, programs,
                           warps, stages, blocks_per_iter, d)
        return run

    def engine(self, splits: int) -> Callable[[], None]:
        """The 32 layers' attention by the engine's split-KV kernel at ``splits`` segments, with
        the key loop the engine's backend gives this batch (``SPLIT_KV_LAUNCH``: 128-key tiles,
        2 stages; until session 9 this ran the kernel's default launch, 64-key tiles and 3
        stages, ~13.5 ms against ~11.5 on the same machine)."""
        def run() -> None:
            for cache in self.caches:
                paged_attention_split_kv(self.q, cache, self.block_table, self.query_start_loc,
                                         self.seq_lens, DECODE_BATCH, HEAD_DIM**-0.5,
                                         self.out, splits, SPLIT_KV_LAUNCH)
        return run


@triton.jit
def persistent_decode_kernel(
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
    TILE_N: tl.constexpr,
    PREFETCH_IDS: tl.constexpr,  # load the next tile's block ids one iteration ahead
    BLOCK_M: tl.constexpr,  # q heads of one kv head, padded: 16 for tl.dot, 64 for wgmma
    L2_AHEAD: tl.constexpr = 0,  # tiles ahead whose K/V lines go to L2 by prefetch (0: none)
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, TILE_N)
    row_mask = offs_m < GROUP
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        kv_head, seq_len, _, bt_row, off, q, acc, m_i, l_i = start_item(
            item, q_ptr, seq_lens_ptr, block_table_ptr, stride_bt, KV_HEADS, GROUP, HEAD_DIM,
            BLOCK_SIZE, BLOCK_M)
        kc = key_cache_ptr + kv_head * HEAD_DIM
        vc = value_cache_ptr + kv_head * HEAD_DIM
        ids = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=offs_n < seq_len, other=0)
        for ahead in tl.static_range(L2_AHEAD):  # the item's first tiles
            prefetch_tile_l2(kc, vc, bt_row, ahead * TILE_N, seq_len, stride_block, stride_off,
                             BLOCK_SIZE, HEAD_DIM, TILE_N)
        for start in range(0, seq_len, TILE_N):
            if L2_AHEAD > 0:
                prefetch_tile_l2(kc, vc, bt_row, start + L2_AHEAD * TILE_N, seq_len,
                                 stride_block, stride_off, BLOCK_SIZE, HEAD_DIM, TILE_N)
            key_pos = start + offs_n
            key_mask = key_pos < seq_len
            if not PREFETCH_IDS:
                ids = tl.load(bt_row + key_pos // BLOCK_SIZE, mask=key_mask, other=0)
            row = ids.to(tl.int64) * stride_block + (key_pos % BLOCK_SIZE) * stride_off
            if PREFETCH_IDS:
                nxt = key_pos + TILE_N
                ids = tl.load(bt_row + nxt // BLOCK_SIZE, mask=nxt < seq_len, other=0)
            k = tl.load(kc + row[None, :] + offs_d[:, None], mask=key_mask[None, :], other=0.0)
            s = tl.dot(q, k) * qk_scale
            s = tl.where(key_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(vc + row[:, None] + offs_d[None, :], mask=key_mask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        tl.store(out_ptr + off, acc / l_i[:, None], mask=row_mask[:, None])


def launch(out, q, cache, block_table, seq_lens, programs: int, tile_n: int, warps: int,
           stages: int, prefetch: bool, block_m: int = 16, l2_ahead: int = 0) -> None:
    """``persistent_decode_kernel`` with ``programs`` programs: q and out
    [num_reqs, heads, head_dim], cache [2, num_blocks, block_size, kv_heads, head_dim], all
    contiguous; ``l2_ahead`` tiles' K/V lines prefetched to L2 ahead of their loads."""
    launch_gathered(persistent_decode_kernel, out, q, cache, block_table, seq_lens, programs,
                    warps, stages, TILE_N=tile_n, PREFETCH_IDS=prefetch, BLOCK_M=block_m,
                    L2_AHEAD=l2_ahead)


def launch_gathered(kernel, out, q, cache, block_table, seq_lens, programs: int, warps: int,
                    stages: int, **constexprs) -> None:
    """``kernel``, a persistent decode kernel with ``persistent_decode_kernel``'s arguments up
    to ``BLOCK_SIZE``, with ``programs`` programs and its own ``constexprs``."""
    k, v = cache[0], cache[1]
    kv_heads, head_dim = k.shape[2], k.shape[3]
    num_items = q.shape[0] * kv_heads
    kernel[(min(programs, num_items),)](
        out, q, k, v, block_table, seq_lens, num_items, head_dim**-0.5 * LOG2_E,
        k.stride(0), k.stride(1), block_table.stride(0),
        KV_HEADS=kv_heads, GROUP=q.shape[1] // kv_heads, HEAD_DIM=head_dim,
        BLOCK_SIZE=k.shape[1], **constexprs, num_warps=warps, num_stages=stages,
    )  # fmt: skip
