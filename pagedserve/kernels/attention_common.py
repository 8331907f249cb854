"""Pieces shared by the paged-attention kernels: the key-tile loop with online softmax, and the
host-side checks of the tensors every attention launch receives (the cache's layout is checked
by the cache-writing kernels too).

Softmax runs in the log2 domain: scores are multiplied by ``scale * log2(e)`` and exponentiated
with ``exp2``; the running maximum ``m`` and sum ``l`` are kept in fp32, in that domain.

An FP8 cache (float8e4nv) is written as ``value / scale`` saturated to +-448 (``to_cache``)
and read back in registers: its elements widen exactly to the dot's dtype (``gpu_dot_dtype``), the keys' scale is
folded into ``qk_scale`` on the host and the values' multiplies the output once
(``scale_values``), which is ``(p @ (v * v_scale))`` up to rounding. Whether the cache is FP8
is the cache pointer's element type, known at compile time, so a cache in the model's dtype
compiles to the code it had without FP8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.fp8_rows import saturate_to_fp8
from pagedserve.kernels.interpreter_compat import INTERPRETING

LOG2_E = 1.4426950408889634
FP8_KV_DTYPE = torch.float8_e4m3fn

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def to_cache(x, scale, cache_ptr):
    """``x`` as the KV cache at ``cache_ptr`` stores it: in the cache's dtype; into an FP8 cache
    ``x / scale`` saturated to +-448, rounded to nearest even (``attention/kv_quant.py``)."""
    cache_dtype: tl.constexpr = cache_ptr.dtype.element_ty
    y = x
    if cache_dtype == tl.float8e4nv:
        y = saturate_to_fp8(tl.div_rn(x.to(tl.float32), scale))
    return y.to(cache_dtype)


@triton.jit
def scale_values(acc, v_scale, value_cache_ptr):
    """``acc`` (sums of p * v over the cache's values) times the values' scale of an FP8 cache;
    unchanged for a cache in the model's dtype."""
    if value_cache_ptr.dtype.element_ty == tl.float8e4nv:
        acc = acc * v_scale
    return acc


def cache_scales(kv_cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The (k_scale, v_scale) the kernels apply: the given ones for an FP8 cache; 1.0 for a
    cache in the model's dtype, which holds the values themselves."""
    if kv_cache.dtype == FP8_KV_DTYPE:
        return k_scale, v_scale
    return 1.0, 1.0


@triton.jit
def _tile_blocks(
    block_table_row_ptr,  # int32 [max_num_blocks_per_req]
    tile_start,
    kv_end,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key of the tile exists
):
    """int64 [TILE_N]: the cache block of each key ``tile_start + i`` (0 past ``kv_end``)."""
    key_pos = tile_start + tl.arange(0, TILE_N)
    if MASKED:
        block = tl.load(block_table_row_ptr + key_pos // BLOCK_SIZE, mask=key_pos < kv_end, other=0)
    else:
        block = tl.load(block_table_row_ptr + key_pos // BLOCK_SIZE)
    return block.to(tl.int64)


@triton.jit
def _attend_tiles(
    acc,  # fp32 [BLOCK_M, HEAD_DIM_PAD]: running unnormalized output
    m_i,  # fp32 [BLOCK_M]: running row maximum (log2 domain)
    l_i,  # fp32 [BLOCK_M]: running row sum of exp2(score - m_i)
    q,  # [BLOCK_M, HEAD_DIM_PAD] in DOT_DTYPE
    q_pos,  # int32 [BLOCK_M]
    kc_head_ptr,  # key cache at this kv head: [num_blocks, block_size, ., head_dim]
    vc_head_ptr,  # value cache at this kv head
    block_table_row_ptr,  # int32 [max_num_blocks_per_req]
    loop_start,
    loop_end,
    kv_end,
    qk_scale,
    stride_kc_block,
    stride_kc_off,
    stride_vc_block,
    stride_vc_off,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    P_DTYPE: tl.constexpr,  # gpu_dot_dtype: the probabilities are rounded to it
    MASKED: tl.constexpr,  # False: every key of every tile exists and every row sees it
):
    """Online-softmax steps over the key tiles ``[t, t + TILE_N)`` for ``t`` from
    ``loop_start`` below ``loop_end``; returns (acc, m_i, l_i)."""
    for tile_start in range(loop_start, loop_end, TILE_N):
        tile_block = _tile_blocks(
            block_table_row_ptr, tile_start, kv_end, BLOCK_SIZE, TILE_N, MASKED
        )
        offs_n = tl.arange(0, TILE_N)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        d_mask = offs_d < HEAD_DIM
        key_pos = tile_start + offs_n
        key_mask = key_pos < kv_end
        k_row = tile_block * stride_kc_block + (key_pos % BLOCK_SIZE) * stride_kc_off
        v_row = tile_block * stride_vc_block + (key_pos % BLOCK_SIZE) * stride_vc_off
        if MASKED:
            k_mask = d_mask[:, None] & key_mask[None, :]
            v_mask = key_mask[:, None] & d_mask[None, :]
        else:
            k_mask = d_mask[:, None]
            v_mask = d_mask[None, :]
        # K^T tile [HEAD_DIM_PAD, TILE_N] and V tile [TILE_N, HEAD_DIM_PAD]
        k = tl.load(kc_head_ptr + k_row[None, :] + offs_d[:, None], mask=k_mask, other=0.0)
        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        s = s * qk_scale
        if MASKED:
            seen = key_mask[None, :] & (key_pos[None, :] <= q_pos[:, None])
            s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vc_head_ptr + v_row[:, None] + offs_d[None, :], mask=v_mask, other=0.0)
        # p is rounded to the dtype the GPU multiplies in (a no-op cast there).
        p = p.to(P_DTYPE).to(DOT_DTYPE)
        v = v.to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def attend_kv_range(
    acc,  # fp32 [BLOCK_M, HEAD_DIM_PAD]: running unnormalized output
    m_i,  # fp32 [BLOCK_M]: running row maximum (log2 domain)
    l_i,  # fp32 [BLOCK_M]: running row sum of exp2(score - m_i)
    q,  # [BLOCK_M, HEAD_DIM_PAD] in DOT_DTYPE, zero on masked rows
    q_pos,  # int32 [BLOCK_M]: position of each row; it sees keys at positions <= q_pos
    min_q_pos,  # the smallest q_pos of a real row (>= kv_start)
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_row_ptr,  # int32 [max_num_blocks_per_req]: this request's block ids
    kv_head,
    kv_start,  # first key position
    kv_end,  # one past the last key position
    qk_scale,  # softmax scale * log2(e)
    stride_kc_block,
    stride_kc_off,
    stride_kc_head,
    stride_vc_block,
    stride_vc_off,
    stride_vc_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    P_DTYPE: tl.constexpr,
):
    """Fold keys ``[kv_start, kv_end)`` of one request and one kv head into (acc, m_i, l_i).

    Tiles that lie wholly below ``min(kv_end, min_q_pos + 1)`` are seen by every row and run
    without masks; the rest (the causal diagonal and the ragged end) are masked. Each key
    position is looked up in the block table on its own, so TILE_N and the cache's block size
    are independent. The first tile holds a key every row sees, so m_i is finite after it.
    Block ids are loaded with their tile, not a tile ahead: prefetching them did not pay
    (docs/gpu.md#attention-launches).
    """
    kc_head_ptr = key_cache_ptr + kv_head * stride_kc_head
    vc_head_ptr = value_cache_ptr + kv_head * stride_vc_head
    full_end = kv_start + (tl.minimum(kv_end, min_q_pos + 1) - kv_start) // TILE_N * TILE_N
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, kc_head_ptr, vc_head_ptr, block_table_row_ptr,
        kv_start, full_end, kv_end, qk_scale,
        stride_kc_block, stride_kc_off, stride_vc_block, stride_vc_off,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, DOT_DTYPE, DOT_PRECISION, P_DTYPE, False,
    )  # fmt: skip
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, kc_head_ptr, vc_head_ptr, block_table_row_ptr,
        full_end, kv_end, kv_end, qk_scale,
        stride_kc_block, stride_kc_off, stride_vc_block, stride_vc_off,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, DOT_DTYPE, DOT_PRECISION, P_DTYPE, True,
    )  # fmt: skip
    return acc, m_i, l_i


def gpu_dot_dtype(query: torch.Tensor, kv_cache: torch.Tensor) -> tl.dtype:
    """The dtype tl.dot multiplies in on the GPU: the query's, except over an FP8 cache, where
    a 16-bit query multiplies in fp16. Every cached element read is widened to the dot's dtype:
    e4m3 widens to fp16 in one instruction per pair (``cvt.rn.f16x2.e4m3x2``), to bf16 only
    through fp32. A bf16 query rounds to fp16 with more mantissa; only magnitudes past 65,504
    (far beyond a rotated query's) would not fit. The probabilities are rounded to this dtype
    too."""
    if kv_cache.dtype == FP8_KV_DTYPE and query.dtype != torch.float32:
        return tl.float16
    return _TL_DTYPES[query.dtype]


def dot_operand_dtype(query: torch.Tensor, kv_cache: torch.Tensor) -> tl.dtype:
    """The dtype the kernel's tl.dot gets: ``gpu_dot_dtype``, except in the Triton interpreter,
    whose tl.dot multiplies the raw bit patterns of bf16 (it has no bf16 arithmetic): there bf16
    operands are widened to fp32 first; bf16 -> fp32 is exact."""
    dtype = gpu_dot_dtype(query, kv_cache)
    if INTERPRETING and dtype == tl.bfloat16:
        return tl.float32
    return dtype


def dot_precision(dtype: tl.dtype) -> str:
    """fp32 models get exact fp32 products (no TF32), so they match the torch reference."""
    return "ieee" if dtype == tl.float32 else "tf32"


def check_kv_cache(kv_cache: torch.Tensor) -> None:
    """The layout every kernel assumes: [2, num_blocks, block_size, num_kv_heads, head_dim]."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "kv_cache: expected [2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(kv_cache.shape)}"
        )
    if kv_cache.stride(4) != 1:
        raise ValueError("kv_cache: the head_dim axis must be contiguous")


def check_attention_args(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    output: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    block_table: torch.Tensor,  # int32 [num_reqs, max_num_blocks_per_req]
) -> None:
    """Raise ValueError naming the tensor whose shape, dtype or layout the kernels cannot take."""
    check_kv_cache(kv_cache)
    if query.dim() != 3 or query.shape[2] != kv_cache.shape[4]:
        raise ValueError(
            f"query: expected [num_tokens, num_heads, {kv_cache.shape[4]}], "
            f"got {tuple(query.shape)}"
        )
    if query.shape[1] % kv_cache.shape[3] != 0:
        raise ValueError(
            f"query: {query.shape[1]} heads is not a multiple of {kv_cache.shape[3]} kv heads"
        )
    if output.shape != query.shape:
        raise ValueError(
            f"output: shape {tuple(output.shape)} differs from query {tuple(query.shape)}"
        )
    if query.dtype not in _TL_DTYPES or kv_cache.dtype not in (query.dtype, FP8_KV_DTYPE):
        raise ValueError(
            f"query/kv_cache: dtypes {query.dtype}/{kv_cache.dtype} (need one of fp32/bf16/fp16, "
            "the cache in the same or float8_e4m3fn)"
        )
    if query.stride(2) != 1 or output.stride(2) != 1:
        raise ValueError("query/output: the head_dim axis must be contiguous")
    if block_table.dtype != torch.int32 or block_table.stride(1) != 1:
        raise ValueError(f"block_table: expected contiguous int32 rows, got {block_table.dtype}")
