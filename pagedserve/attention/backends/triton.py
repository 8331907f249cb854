"""The GPU attention backend: Triton kernels for the rotary embedding + KV-cache write and the
paged attention.

``torch_ref`` is its oracle. Every launch decision is made from host-known metadata
(``num_reqs``, ``num_actual_tokens``, ``max_query_len``, ``max_seq_len``), never from device
tensors, so a step never waits for the GPU and the launches can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch

from pagedserve.attention.backends.base import UNIT_KV_SCALES, AttentionMetadata, KVScales
from pagedserve.kernels import sm_count
from pagedserve.kernels.attention_common import FP8_KV_DTYPE, check_attention_args
from pagedserve.kernels.paged_attention import KeyLoopLaunch, paged_attention
from pagedserve.kernels.paged_attention_split import MAX_NUM_SPLITS, paged_attention_split_kv
from pagedserve.kernels.rope_kv_write import rope_and_write_kv

# Programs per streaming multiprocessor the split-KV path aims for (one program per request,
# kv head and segment).
_PROGRAMS_PER_SM = 4
# Key loops, chosen with benchmarks/attention_sweep.py and then in the engine (docs/gpu.md,
# "Attention launches"). Every decode batch runs the split-KV kernel: with 128-key tiles when
# it is split or its (request, kv head) pairs exceed the target programs, with 64-key tiles
# when one segment per pair leaves SMs short of programs (then shorter tiles keep more
# programs in flight). Over an FP8 cache a 128-key tile holds the bytes of a 64-key one in
# bf16, and it is the faster tile at every batch. Batches with prefill rows run the varlen
# kernel; over an FP8 cache with 128-row query tiles, which widen each key tile once for twice
# the rows.
SPLIT_KV_LAUNCH = KeyLoopLaunch(tile_n=128, num_warps=4, num_stages=2)
FEW_PAIRS_LAUNCH = KeyLoopLaunch(tile_n=64, num_warps=4, num_stages=2)
PREFILL_LAUNCH = KeyLoopLaunch(num_stages=2)
FP8_PREFILL_LAUNCH = KeyLoopLaunch(tile_n=64, num_warps=4, num_stages=3, block_m=128)


def choose_num_splits(
    num_reqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    target_programs: int,
    min_keys_per_split: int,
) -> int:
    """Segments per request for a decode batch: enough programs to fill the GPU, each with at
    least ``min_keys_per_split`` keys of the longest context; a power of two, at most
    ``MAX_NUM_SPLITS`` (32). Every count runs the same compiled split-KV kernels."""
    by_occupancy = target_programs // max(1, num_reqs * num_kv_heads)
    by_length = max_seq_len // max(1, min_keys_per_split)
    wanted = min(MAX_NUM_SPLITS, by_occupancy, by_length)
    if wanted < 2:
        return 1
    return 1 << (wanted.bit_length() - 1)


def decode_launch(
    num_splits: int, num_pairs: int, target_programs: int, cache_dtype: torch.dtype
) -> KeyLoopLaunch:
    """The split-KV kernel's key loop for a decode batch of ``num_pairs`` (request, kv head)
    pairs cut into ``num_splits`` segments each, over a cache of ``cache_dtype``."""
    if num_splits > 1 or num_pairs > target_programs or cache_dtype == FP8_KV_DTYPE:
        return SPLIT_KV_LAUNCH
    return FEW_PAIRS_LAUNCH


def prefill_launch(cache_dtype: torch.dtype) -> KeyLoopLaunch:
    """The varlen kernel's launch for batches with prefill rows."""
    return FP8_PREFILL_LAUNCH if cache_dtype == FP8_KV_DTYPE else PREFILL_LAUNCH


def decodes_apart(num_decodes: int, cache_dtype: torch.dtype) -> int:
    """How many of a mixed batch's leading one-row queries run the split-KV kernel before the
    varlen kernel runs the rest: all of them over an FP8 cache, where the varlen launch's
    128-row query tiles would hold 4 real rows of a decode and widen every key for them; none
    over a cache in the model's dtype, where one launch overlaps the decode rows' reads with
    the prompts' math and measured as fast (docs/gpu.md#attention-launches)."""
    return num_decodes if cache_dtype == FP8_KV_DTYPE else 0


class TritonBackend:
    """AttentionBackend on Triton kernels.

    Batches whose queries are all single rows (``max_query_len == 1``) run the split-KV decode
    kernel (segments from ``choose_num_splits``, key loop from ``decode_launch``); batches
    with prefill rows run the varlen kernel, after the split-KV kernel has run their leading
    single-row requests where ``decodes_apart`` says so. Under a FULL CUDA graph both choices
    are fixed at capture (from the capture's ``num_reqs`` and ``max_seq_len``); the results
    stay exact for any replayed seq_lens.
    """

    name = "triton"

    def __init__(self, target_programs: int | None = None, min_keys_per_split: int = 128) -> None:
        if min_keys_per_split < 1:
            raise ValueError(f"min_keys_per_split: must be >= 1, got {min_keys_per_split}")
        self.target_programs = target_programs or _PROGRAMS_PER_SM * sm_count()
        self.min_keys_per_split = min_keys_per_split

    def rope_and_write_kv(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        cos_sin: torch.Tensor,  # [num_tokens, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [num_tokens]
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> torch.Tensor:
        """One kernel in place of Inductor's rotation kernels plus a cache-write kernel: each
        token's q, k, v are read once (figures: docs/gpu.md, "Fused kernels")."""
        return rope_and_write_kv(query, key, value, cos_sin, kv_cache, slot_mapping,
                                 kv_scales.k, kv_scales.v)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        output: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> None:
        """Causal attention of each query row over its request's cache (an FP8 one
        dequantized in registers); writes ``output[:num_actual_tokens]`` only."""
        check_attention_args(query, kv_cache, output, metadata.block_table)
        if not metadata.causal:
            raise ValueError("metadata.causal: the triton backend only runs causal attention")
        if metadata.num_actual_tokens == 0:
            return
        if metadata.max_query_len == 1:
            num_apart = metadata.num_reqs
        else:
            num_apart = decodes_apart(metadata.num_decodes, kv_cache.dtype)
        self.forward_apart(query, kv_cache, metadata, num_apart, scale, output, kv_scales)

    def forward_apart(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        num_apart: int,
        scale: float,
        output: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> None:
        """``forward``'s launches, with the first ``num_apart`` requests (one query row each)
        on the split-KV kernel and the rest on the varlen kernel, whose rows then start at
        ``num_apart``. ``forward`` picks ``num_apart``; ``benchmarks/mixed_attention.py`` times
        both ways."""
        if num_apart > 0:
            num_kv_heads = kv_cache.shape[3]
            num_splits = choose_num_splits(
                num_apart, num_kv_heads, metadata.max_seq_len, self.target_programs,
                self.min_keys_per_split,
            )  # fmt: skip
            launch = decode_launch(
                num_splits, num_apart * num_kv_heads, self.target_programs, kv_cache.dtype
            )
            paged_attention_split_kv(
                query, kv_cache, *_request_rows(metadata, 0, num_apart), num_apart, scale,
                output, num_splits, launch, kv_scales.k, kv_scales.v,
            )  # fmt: skip
        if num_apart == metadata.num_reqs:
            return
        paged_attention(
            query, kv_cache, *_request_rows(metadata, num_apart, metadata.num_reqs),
            metadata.num_reqs - num_apart, metadata.num_actual_tokens, metadata.max_query_len,
            scale, output, prefill_launch(kv_cache.dtype), kv_scales.k, kv_scales.v, num_apart,
        )  # fmt: skip


def _request_rows(
    metadata: AttentionMetadata, start: int, stop: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block_table, query_start_loc, seq_lens) of requests ``start:stop``; the tensors
    themselves when that is all of them."""
    if start == 0 and stop == metadata.num_reqs:
        return metadata.block_table, metadata.query_start_loc, metadata.seq_lens
    return (metadata.block_table[start:stop], metadata.query_start_loc[start : stop + 1],
            metadata.seq_lens[start:stop])  # fmt: skip
