"""Rotary embedding of a step's queries and keys, and the KV-cache write, in one kernel.

Unfused, a decode step spends three kernels per layer here (Inductor's rotation of the queries
and of the keys, then the cache scatter); this kernel reads each token's q, k, v and cos | sin
once, writes the rotated queries to a new buffer and the rotated keys and the values into the
paged cache through the slot mapping (PAD_SLOT_ID rows write no cache entry).

Into an FP8 cache the rotated keys and the values go as ``value / scale`` (one scale for the
keys, one for the values), saturated to +-448 and rounded to nearest even, byte for byte as
``attention/kv_quant.py``; the keys are rounded to the model dtype first, as there.

Neox-style rotation as ``layers/rotary.py``, with the same rounding steps as that torch code
run eagerly in the model dtype: each product rounded, then each sum. Under the interpreter the
results are bit-equal to it; compiled for a GPU, some differ by one rounding step, in fp32
too, where there is no intermediate rounding to copy (most likely multiply-adds contracted by
the compiler; docs/gpu.md, "Fused kernels").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.attention_common import FP8_KV_DTYPE, cache_scales, check_kv_cache, to_cache


@triton.jit
def _rotate(x1, x2, cos, sin):
    """(x1 * cos - x2 * sin, x2 * cos + x1 * sin) with every op rounded to x's dtype."""
    dt = x1.dtype
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    a = (x1f * cos).to(dt).to(tl.float32)
    b = (x2f * sin).to(dt).to(tl.float32)
    c = (x2f * cos).to(dt).to(tl.float32)
    e = (x1f * sin).to(dt).to(tl.float32)
    return (a - b).to(dt), (c + e).to(dt)


@triton.jit
def _rope_kv_write_kernel(
    query_ptr,  # [num_tokens, num_heads * head_dim]
    key_ptr,  # [num_tokens, num_kv_heads * head_dim]
    value_ptr,  # [num_tokens, num_kv_heads * head_dim]
    cos_sin_ptr,  # [num_tokens, head_dim]: cos half | sin half
    query_out_ptr,  # [num_tokens, num_heads * head_dim] (out)
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # int64 [>= num_tokens]
    k_scale,  # an FP8 cache's scales (unused for a cache in the model's dtype)
    v_scale,
    stride_q_tok,
    stride_k_tok,
    stride_v_tok,
    stride_cs_tok,
    stride_qo_tok,
    stride_kc_block,
    stride_kc_off,
    stride_kc_head,
    stride_vc_block,
    stride_vc_off,
    stride_vc_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, HALF_PAD)[None, :]  # [1, HALF_PAD]: a pair's index in the head
    dim_ok = dims < half
    cs_row = cos_sin_ptr + token * stride_cs_tok
    cos = tl.load(cs_row + dims, mask=dim_ok, other=0.0).to(tl.float32)
    sin = tl.load(cs_row + half + dims, mask=dim_ok, other=0.0).to(tl.float32)

    heads = tl.arange(0, HEADS_PAD)[:, None]  # [HEADS_PAD, 1]
    mask = (heads < NUM_HEADS) & dim_ok
    q_row = query_ptr + token * stride_q_tok + heads * HEAD_DIM + dims
    q1, q2 = _rotate(tl.load(q_row, mask=mask), tl.load(q_row + half, mask=mask), cos, sin)
    qo_row = query_out_ptr + token * stride_qo_tok + heads * HEAD_DIM + dims
    tl.store(qo_row, q1, mask=mask)
    tl.store(qo_row + half, q2, mask=mask)

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # PAD_SLOT_ID: a padding row, nothing lands in the cache
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    kv_heads = tl.arange(0, KV_HEADS_PAD)[:, None]  # [KV_HEADS_PAD, 1]
    kv_mask = (kv_heads < NUM_KV_HEADS) & dim_ok
    k_row = key_ptr + token * stride_k_tok + kv_heads * HEAD_DIM + dims
    k1, k2 = _rotate(tl.load(k_row, mask=kv_mask), tl.load(k_row + half, mask=kv_mask), cos, sin)
    kc = key_cache_ptr + block * stride_kc_block + offset * stride_kc_off
    kc += kv_heads * stride_kc_head + dims
    tl.store(kc, to_cache(k1, k_scale, kc), mask=kv_mask)
    tl.store(kc + half, to_cache(k2, k_scale, kc), mask=kv_mask)
    v_row = value_ptr + token * stride_v_tok + kv_heads * HEAD_DIM + dims
    vc = value_cache_ptr + block * stride_vc_block + offset * stride_vc_off
    vc += kv_heads * stride_vc_head + dims
    tl.store(vc, to_cache(tl.load(v_row, mask=kv_mask), v_scale, vc), mask=kv_mask)
    tl.store(vc + half, to_cache(tl.load(v_row + half, mask=kv_mask), v_scale, vc), mask=kv_mask)


def _check(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos_sin: torch.Tensor,
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:  # fmt: skip
    check_kv_cache(kv_cache)
    num_tokens, head_dim = query.shape[0], kv_cache.shape[4]
    kv_width = kv_cache.shape[3] * head_dim
    if key.shape != (num_tokens, kv_width) or value.shape != key.shape:
        raise ValueError(
            f"key/value: expected [{num_tokens}, {kv_width}], got {tuple(key.shape)}, "
            f"{tuple(value.shape)}"
        )
    if query.dim() != 2 or query.shape[1] % head_dim != 0 or head_dim % 2 != 0:
        raise ValueError(f"query: expected [num_tokens, num_heads * {head_dim}], got {tuple(query.shape)}")
    if cos_sin.shape != (num_tokens, head_dim):
        raise ValueError(f"cos_sin: expected [{num_tokens}, {head_dim}], got {tuple(cos_sin.shape)}")
    if any(t.dtype != query.dtype for t in (key, value)) or kv_cache.dtype not in (
        query.dtype, FP8_KV_DTYPE
    ):
        raise ValueError(f"query/key/value: dtype must be one, the cache's ({kv_cache.dtype}) "
                         "unless the cache is float8_e4m3fn")
    if any(t.stride(1) != 1 for t in (query, key, value, cos_sin)):
        raise ValueError("query/key/value/cos_sin: the feature axis must be contiguous")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape[0] < num_tokens:
        raise ValueError(
            f"slot_mapping: expected int64 with >= {num_tokens} entries (a longer persistent "
            f"buffer is fine), got {slot_mapping.dtype} [{slot_mapping.shape[0]}]"
        )


def rope_and_write_kv(
    query: torch.Tensor,  # [num_tokens, num_heads * head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
    cos_sin: torch.Tensor,  # [num_tokens, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [>= num_tokens]
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The rotated queries ([num_tokens, num_heads * head_dim], a new buffer); the rotated keys
    and the values land in ``kv_cache`` at each token's slot (an FP8 cache's divided by
    ``k_scale`` / ``v_scale``). One program per token."""
    _check(query, key, value, cos_sin, kv_cache, slot_mapping)
    num_tokens = query.shape[0]
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return query_out
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    num_heads = query.shape[1] // head_dim
    k_scale, v_scale = cache_scales(kv_cache, k_scale, v_scale)
    _rope_kv_write_kernel[(num_tokens,)](
        query, key, value, cos_sin, query_out, key_cache, value_cache, slot_mapping,
        k_scale, v_scale,
        query.stride(0), key.stride(0), value.stride(0), cos_sin.stride(0), query_out.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF_PAD=triton.next_power_of_2(head_dim // 2), BLOCK_SIZE=kv_cache.shape[2],
    )  # fmt: skip
    return query_out
