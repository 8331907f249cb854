"""Varlen paged attention: every query row of a step against its request's keys in the cache.

Request ``i`` owns query rows ``query_start_loc[i] : query_start_loc[i + 1]``; row ``j`` of it sits
at position ``seq_lens[i] - query_len_i + j`` and sees the keys at positions up to its own (the
cached prefix comes first). Keys are read through the request's block table.

One program handles BLOCK_Q consecutive query rows of one request and *all* the q heads that share
one kv head (GQA), so each K/V tile is loaded once for the group: its tile has
``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows, row ``r`` being query ``r // GROUP_PAD`` and head
``kv_head * GROUP + r % GROUP_PAD``. Programs are numbered over all requests without a host sync:
request ``i``'s query blocks start at ``query_start_loc[i] // BLOCK_Q + i``, so
``num_actual_tokens // BLOCK_Q + num_reqs`` programs cover every block (extra ones exit at once).
A launch over the later requests of a batch (the earlier ones decoded apart) passes
``query_start_loc`` from its first request on, and its programs start at that request's first
block (``first_q_block``).
"""

from __future__ import annotations

from dataclasses import dataclass

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

# Rows of one program's query tile (query rows x grouped heads) for prefill-sized queries.
_MAX_BLOCK_M = 64
# tl.dot needs every dimension >= 16 on NVIDIA GPUs.
_MIN_DOT = 16


@triton.jit
def _find_request(query_start_loc_ptr, q_block_idx, num_reqs, BLOCK_Q: tl.constexpr):
    """The last request i whose first query block ``query_start_loc[i] // BLOCK_Q + i`` is
    <= q_block_idx (binary search; query_start_loc is non-decreasing)."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_reqs", "first_q_block"])  # per-step ints: kernels/__init__
def _paged_attention_kernel(
    output_ptr,  # [num_tokens, num_heads, head_dim]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,  # int32 [num_reqs, max_num_blocks_per_req]
    seq_lens_ptr,  # int32 [num_reqs]
    query_start_loc_ptr,  # int32 [num_reqs + 1]
    num_reqs,
    first_q_block,  # query_start_loc[0] // BLOCK_Q: the first request's first query block
    qk_scale,  # softmax scale * log2(e) * the keys' FP8 scale
    v_scale,  # the values' FP8 scale (unused for a cache in the model's dtype)
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
    GROUP: tl.constexpr,  # q heads per kv head
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    P_DTYPE: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    q_block_global = tl.program_id(0) + first_q_block
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, q_block_global, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + req)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_idx = q_block * BLOCK_Q + offs_m // GROUP_PAD  # query row within the request
    head = kv_head * GROUP + offs_m % GROUP_PAD
    row_mask = (q_idx < q_len) & (offs_m % GROUP_PAD < GROUP)
    mask = row_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    token = (q_start + q_idx).to(tl.int64)
    q_off = token[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(query_ptr + q_off, mask=mask, other=0.0).to(DOT_DTYPE)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Causal: the last row of this block sees keys up to context_len + (q_block + 1) * BLOCK_Q - 1.
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    acc, m_i, l_i = attend_kv_range(
        acc, m_i, l_i, q, context_len + q_idx, context_len + q_block * BLOCK_Q,
        key_cache_ptr, value_cache_ptr, block_table_ptr + req.to(tl.int64) * stride_bt, kv_head,
        0, kv_end, qk_scale,
        stride_kc_block, stride_kc_off, stride_kc_head,
        stride_vc_block, stride_vc_off, stride_vc_head,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, DOT_DTYPE, DOT_PRECISION, P_DTYPE,
    )  # fmt: skip
    acc = scale_values(acc, v_scale, value_cache_ptr)
    # A row that saw no key (only under malformed metadata: seq_len < query_len) writes 0, not NaN.
    out = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0)
    o_off = token[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
    tl.store(output_ptr + o_off, out, mask=mask)


def choose_block_m(max_query_len: int, group_pad: int) -> int:
    """Query-tile rows: just enough for the longest query (decode: one row per head), at least
    the 16 tl.dot needs, at most 64 (or one query's heads when the group alone is larger)."""
    if group_pad >= _MAX_BLOCK_M:
        return group_pad
    wanted = triton.next_power_of_2(max(max_query_len, 1)) * group_pad
    return max(_MIN_DOT, min(_MAX_BLOCK_M, wanted))


def key_tile_size(head_dim_pad: int) -> int:
    return 64 if head_dim_pad <= 128 else 32


@dataclass(frozen=True)
class KeyLoopLaunch:
    """How a paged-attention kernel walks the keys: keys per tile (None: ``key_tile_size``),
    warps per program, Triton's software-pipelining depth, for the varlen kernel the query-tile
    rows (None: ``choose_block_m``; a power of two >= 16 holding whole GQA groups; the split-KV
    kernel ignores it)."""

    tile_n: int | None = None
    num_warps: int = 4
    num_stages: int = 3
    block_m: int | None = None

    def tile(self, head_dim_pad: int) -> int:
        return self.tile_n or key_tile_size(head_dim_pad)

    def query_rows(self, max_query_len: int, group_pad: int) -> int:
        if self.block_m is None:
            return choose_block_m(max_query_len, group_pad)
        if self.block_m < max(_MIN_DOT, group_pad) or self.block_m & (self.block_m - 1):
            raise ValueError(
                f"block_m: {self.block_m} must be a power of two >= 16 and >= the GQA group "
                f"({group_pad})"
            )
        return self.block_m


DEFAULT_LAUNCH = KeyLoopLaunch()


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # int32 [num_reqs, max_num_blocks_per_req]
    query_start_loc: torch.Tensor,  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor,  # int32 [num_reqs]
    num_reqs: int,
    num_actual_tokens: int,
    max_query_len: int,
    scale: float,
    output: torch.Tensor,  # [num_tokens, num_heads, head_dim] (out)
    launch: KeyLoopLaunch = DEFAULT_LAUNCH,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    first_token: int = 0,
) -> None:
    """Causal varlen attention over the paged cache; writes the rows
    ``output[first_token:num_actual_tokens]`` only, ``first_token`` being ``query_start_loc[0]``
    (0 for a whole batch; the rows of earlier requests for a launch over the later ones).
    ``k_scale`` / ``v_scale``: an FP8 cache's scales (ignored for one in the model's dtype).

    Arguments are trusted (the backend checks them); all sizes are host-known ints.
    """
    if num_reqs == 0 or num_actual_tokens == 0:
        return
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    num_heads, head_dim = query.shape[1], query.shape[2]
    group = num_heads // key_cache.shape[2]
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    block_m = launch.query_rows(max_query_len, group_pad)
    block_q = block_m // group_pad
    dot_dtype = dot_operand_dtype(query, kv_cache)
    k_scale, v_scale = cache_scales(kv_cache, k_scale, v_scale)
    first_q_block = first_token // block_q
    grid = (num_actual_tokens // block_q + num_reqs - first_q_block, key_cache.shape[2])
    _paged_attention_kernel[grid](
        output, query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        num_reqs, first_q_block, scale * LOG2_E * k_scale, v_scale,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=key_cache.shape[1], BLOCK_M=block_m, TILE_N=launch.tile(head_dim_pad),
        DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision(dot_dtype), P_DTYPE=gpu_dot_dtype(query, kv_cache),
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
