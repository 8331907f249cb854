"""Split-KV paged attention for decode batches (every request has at most one query row).

A decode batch has few query rows, so one program per (request, kv head) leaves most of the GPU
idle on long contexts. Here each request's keys are cut into ``num_splits`` segments of
``ceil(ceil(seq_len / num_splits) / TILE_N) * TILE_N`` keys that run in parallel; each segment
writes its unnormalized partial output with its softmax max and sum (log2 domain), and a reduce
kernel rescales and sums the segments (with one segment the kernel writes the normalized output
itself and no reduce runs). ``num_splits`` is chosen on the host per batch; the segment length
comes from ``seq_lens`` on the device, so any replay of the same launch stays correct.

One program per (request, kv head, segment) item, numbered segment fastest; it finds its
request by division, where the varlen kernel searches ``query_start_loc``.

``num_splits`` is a runtime argument, not a constexpr: every split count shares one compiled
variant of each kernel (a constexpr count compiled a new variant per count, in the middle of
FULL-graph capture). The reduce kernel loads a fixed
``MAX_NUM_SPLITS``-wide tile of segments and masks the ones past ``num_splits``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.attention_common import (
    LOG2_E,
    attend_kv_range,
    cache_scales,
    dot_operand_dtype,
    dot_precision,
    gpu_dot_dtype,
    scale_values,
)
from pagedserve.kernels.paged_attention import DEFAULT_LAUNCH, KeyLoopLaunch

# tl.dot needs every dimension >= 16 on NVIDIA GPUs.
_MIN_DOT = 16
MAX_NUM_SPLITS = 32
"""The most segments per request: the reduce kernel's (constexpr) tile of segments."""


@triton.jit
def _segment_len(seq_len, num_splits, TILE_N: tl.constexpr):
    keys_per_split = (seq_len + num_splits - 1) // num_splits
    return (keys_per_split + TILE_N - 1) // TILE_N * TILE_N


@triton.jit(do_not_specialize=["num_splits"])  # per-step ints: kernels/__init__
def _split_kv_kernel(
    output_ptr,  # [num_tokens, num_heads, head_dim] (written when num_splits == 1)
    partial_out_ptr,  # fp32 [num_reqs, num_heads, num_splits, HEAD_DIM_PAD]
    partial_max_ptr,  # fp32 [num_reqs, num_heads, num_splits]
    partial_sum_ptr,  # fp32 [num_reqs, num_heads, num_splits]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,  # int32 [num_reqs, max_num_blocks_per_req]
    seq_lens_ptr,  # int32 [num_reqs]
    query_start_loc_ptr,  # int32 [num_reqs + 1]
    qk_scale,  # softmax scale * log2(e) * the keys' FP8 scale
    v_scale,  # the values' FP8 scale (unused for a cache in the model's dtype)
    num_splits,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_kc_block,
    stride_kc_off,
    stride_kc_head,
    stride_vc_block,
    stride_vc_off,
    stride_vc_head,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # >= GROUP: rows are the q heads of one kv head
    TILE_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    P_DTYPE: tl.constexpr,
):
    """One program per item (request, kv head, segment), segment fastest: the decode row of
    every q head of the kv head against the segment's keys. It writes the normalized output when
    the request is one segment, else the segment's unnormalized output and softmax statistics
    for the reduce kernel."""
    NUM_KV_HEADS: tl.constexpr = NUM_HEADS // GROUP
    item = tl.program_id(0)
    split = item % num_splits
    kv_head = (item // num_splits) % NUM_KV_HEADS
    req = item // (num_splits * NUM_KV_HEADS)
    q_start = tl.load(query_start_loc_ptr + req)
    seq_len = tl.load(seq_lens_ptr + req)
    seg_len = _segment_len(seq_len, num_splits, TILE_N)
    kv_start = split * seg_len
    kv_end = tl.minimum(seq_len, kv_start + seg_len)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    head = kv_head * GROUP + offs_m
    row_mask = offs_m < GROUP
    mask = row_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    token = q_start.to(tl.int64)
    # Skipped: a request without a query row this step, and an empty segment after the first
    # (the reduce kernel skips it too).
    live = (kv_start < seq_len) | (split == 0)
    if (tl.load(query_start_loc_ptr + req + 1) > q_start) & live:
        q_off = token * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :]
        q = tl.load(query_ptr + q_off, mask=mask, other=0.0).to(DOT_DTYPE)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + (seq_len - 1)  # the row sees every key
        acc, m_i, l_i = attend_kv_range(
            acc, m_i, l_i, q, q_pos, seq_len - 1,
            key_cache_ptr, value_cache_ptr, block_table_ptr + req.to(tl.int64) * stride_bt,
            kv_head, kv_start, kv_end, qk_scale,
            stride_kc_block, stride_kc_off, stride_kc_head,
            stride_vc_block, stride_vc_off, stride_vc_head,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, DOT_DTYPE, DOT_PRECISION, P_DTYPE,
        )  # fmt: skip
        acc = scale_values(acc, v_scale, value_cache_ptr)
        if num_splits == 1:
            o_off = token * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
            out = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0)  # 0 if no keys
            tl.store(output_ptr + o_off, out, mask=mask)
        else:
            stat_off = (req.to(tl.int64) * NUM_HEADS + head) * num_splits + split  # [BLOCK_M]
            tl.store(partial_max_ptr + stat_off, m_i, mask=row_mask)
            tl.store(partial_sum_ptr + stat_off, l_i, mask=row_mask)
            out_off = stat_off[:, None] * HEAD_DIM_PAD + offs_d[None, :]
            tl.store(partial_out_ptr + out_off, acc, mask=row_mask[:, None])


@triton.jit(do_not_specialize=["num_splits"])  # per-step ints: kernels/__init__
def _reduce_splits_kernel(
    output_ptr,  # [num_tokens, num_heads, head_dim]
    partial_out_ptr,  # fp32 [num_reqs, num_heads, num_splits, HEAD_DIM_PAD]
    partial_max_ptr,  # fp32 [num_reqs, num_heads, num_splits]
    partial_sum_ptr,  # fp32 [num_reqs, num_heads, num_splits]
    seq_lens_ptr,  # int32 [num_reqs]
    query_start_loc_ptr,  # int32 [num_reqs + 1]
    num_splits,
    stride_o_tok,
    stride_o_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # >= num_splits: the segments' tile
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) == q_start:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    seg_len = _segment_len(seq_len, num_splits, TILE_N)
    splits = tl.arange(0, SPLITS_PAD)
    # Segments the split kernel wrote: launched (< num_splits) and not empty.
    live = (splits < num_splits) & (splits * seg_len < seq_len)
    stat_off = (req.to(tl.int64) * NUM_HEADS + head) * num_splits + splits
    seg_max = tl.load(partial_max_ptr + stat_off, mask=live, other=float("-inf"))
    seg_sum = tl.load(partial_sum_ptr + stat_off, mask=live, other=0.0)
    new_max = tl.max(seg_max, 0)
    weight = tl.where(live, tl.exp2(seg_max - new_max), 0.0)  # [SPLITS_PAD]
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    seg_out = tl.load(
        partial_out_ptr + stat_off[:, None] * HEAD_DIM_PAD + offs_d[None, :],
        mask=live[:, None],
        other=0.0,
    )
    total = tl.sum(seg_sum * weight, 0)
    out = tl.where(total > 0, tl.sum(seg_out * weight[:, None], 0) / total, 0.0)  # 0 if no keys
    o_off = q_start.to(tl.int64) * stride_o_tok + head * stride_o_head + offs_d
    tl.store(output_ptr + o_off, out, mask=offs_d < HEAD_DIM)


def paged_attention_split_kv(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # int32 [num_reqs, max_num_blocks_per_req]
    query_start_loc: torch.Tensor,  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor,  # int32 [num_reqs]
    num_reqs: int,
    scale: float,
    output: torch.Tensor,  # [num_tokens, num_heads, head_dim] (out)
    num_splits: int,
    launch: KeyLoopLaunch = DEFAULT_LAUNCH,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Decode attention (max_query_len <= 1) with each request's keys split into ``num_splits``
    (1 to ``MAX_NUM_SPLITS``) parallel segments. Writes only the rows ``query_start_loc[i]`` of
    requests with a query row. Every split count runs the same compiled kernels; one segment
    needs no reduce kernel. ``k_scale`` / ``v_scale``: an FP8 cache's scales (ignored for one
    in the model's dtype); the segments' partial outputs are already scaled."""
    if not 1 <= num_splits <= MAX_NUM_SPLITS:
        raise ValueError(f"num_splits: must be in 1..{MAX_NUM_SPLITS}, got {num_splits}")
    if num_reqs == 0:
        return
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    num_heads, head_dim = query.shape[1], query.shape[2]
    group = num_heads // key_cache.shape[2]
    head_dim_pad = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    tile_n = launch.tile(head_dim_pad)
    dot_dtype = dot_operand_dtype(query, kv_cache)
    k_scale, v_scale = cache_scales(kv_cache, k_scale, v_scale)
    stats_shape = (num_reqs, num_heads, num_splits)
    device = query.device
    # fp32 [num_reqs, num_heads, num_splits, head_dim_pad]: unnormalized segment outputs
    partial_out = torch.empty((*stats_shape, head_dim_pad), dtype=torch.float32, device=device)
    partial_max = torch.empty(stats_shape, dtype=torch.float32, device=device)  # log2 domain
    partial_sum = torch.empty_like(partial_max)  # fp32 [num_reqs, num_heads, num_splits]
    _split_kv_kernel[(num_reqs * key_cache.shape[2] * num_splits,)](
        output, partial_out, partial_max, partial_sum,
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        scale * LOG2_E * k_scale, v_scale, num_splits,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0),
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=key_cache.shape[1], BLOCK_M=max(_MIN_DOT, triton.next_power_of_2(group)),
        TILE_N=tile_n,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision(dot_dtype), P_DTYPE=gpu_dot_dtype(query, kv_cache),
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    if num_splits == 1:
        return  # the one segment wrote the normalized output itself
    _reduce_splits_kernel[(num_reqs, num_heads)](
        output, partial_out, partial_max, partial_sum, seq_lens, query_start_loc, num_splits,
        output.stride(0), output.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        TILE_N=tile_n, SPLITS_PAD=MAX_NUM_SPLITS,
        num_warps=4,
    )  # fmt: skip
