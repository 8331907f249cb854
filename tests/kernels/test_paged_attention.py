"""Paged attention kernels against a dense causal reference (on the GPU where there is one,
else on the CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE
from paged_kv_cases import (
    SENTINEL,
    dense_causal_attention,
    make_paged_batch,
    write_step_kv,
)

from pagedserve.kernels.paged_attention import KeyLoopLaunch, paged_attention
from pagedserve.kernels.paged_attention_split import MAX_NUM_SPLITS, paged_attention_split_kv

TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def _run_varlen(batch, scale: float) -> torch.Tensor:
    meta = batch.metadata
    output = torch.full_like(batch.query, SENTINEL)
    paged_attention(
        batch.query, batch.kv_cache, meta.block_table, meta.query_start_loc, meta.seq_lens,
        meta.num_reqs, meta.num_actual_tokens, meta.max_query_len, scale, output,
    )  # fmt: skip
    return output


def _check(batch, output: torch.Tensor, scale: float) -> None:
    num_tokens = batch.metadata.num_actual_tokens
    expected = dense_causal_attention(batch, scale)
    tol = TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(output[:num_tokens].float(), expected, **tol)
    assert (output[num_tokens:] == SENTINEL).all(), "padding rows were written"


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2)])
def test_pure_prefill_gqa(num_heads: int, num_kv_heads: int) -> None:
    # 77 rows: query blocks whose causal diagonal crosses the first 64-key tile.
    batch = make_paged_batch(
        [5, 77], [0, 0], num_heads, num_kv_heads, 64, 16, torch.float32, device=DEVICE
    )
    write_step_kv(batch)
    _check(batch, _run_varlen(batch, 0.125), 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_with_cached_prefix(dtype: torch.dtype) -> None:
    # head_dim 128. Prefixes end mid-block; the second request's second query block starts at
    # position 62, just below a tile edge; the third spans two whole 64-key tiles (the unmasked
    # loop) before its queries, which cross a block edge.
    batch = make_paged_batch([7, 40, 20], [19, 30, 133], 4, 2, 128, 16, dtype, device=DEVICE)
    write_step_kv(batch)
    _check(batch, _run_varlen(batch, 128**-0.5), 128**-0.5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_decode_and_prefill(dtype: torch.dtype) -> None:
    # Decodes first (one at a block's first offset, one at its last), then chunked prefills.
    batch = make_paged_batch([1, 1, 9, 16], [140, 7, 12, 16], 8, 2, 64, 8, dtype, device=DEVICE)
    write_step_kv(batch)
    _check(batch, _run_varlen(batch, 0.125), 0.125)


def test_head_dim_not_power_of_two() -> None:
    # group 3, head_dim 80
    batch = make_paged_batch([3, 6], [5, 0], 6, 2, 80, 16, torch.float32, device=DEVICE)
    write_step_kv(batch)
    _check(batch, _run_varlen(batch, 80**-0.5), 80**-0.5)


@pytest.mark.parametrize(
    "dtype,num_splits",
    [(torch.float32, 2), (torch.float32, 3), (torch.float32, 4), (torch.bfloat16, 8),
     (torch.float32, 32)],
)  # fmt: skip
def test_split_kv_decode_long_context(dtype: torch.dtype, num_splits: int) -> None:
    # Block size 4: the longest context spans 66 blocks; some requests leave segments empty
    # (32 splits: every request; 3: a count the reduce kernel's 32-wide tile must mask).
    batch = make_paged_batch([1, 1, 1], [150, 37, 263], 8, 2, 64, 4, dtype, device=DEVICE)
    write_step_kv(batch)
    meta = batch.metadata
    output = torch.full_like(batch.query, SENTINEL)
    paged_attention_split_kv(
        batch.query, batch.kv_cache, meta.block_table, meta.query_start_loc, meta.seq_lens,
        meta.num_reqs, 0.125, output, num_splits,
    )  # fmt: skip
    _check(batch, output, 0.125)


def test_split_kv_one_segment_writes_the_output_itself() -> None:
    # No reduce kernel: the lone segment normalizes. A padded request (no query row) is skipped.
    batch = make_paged_batch(
        [1, 1, 1], [150, 3, 263], 8, 2, 64, 4, torch.float32, num_padding=1, device=DEVICE
    )
    write_step_kv(batch)
    meta = batch.metadata
    qsl = torch.cat([meta.query_start_loc, meta.query_start_loc[-1:]])
    table = torch.cat([meta.block_table, meta.block_table[:1]])
    seq_lens = torch.cat([meta.seq_lens, torch.zeros(1, dtype=torch.int32, device=DEVICE)])
    output = torch.full_like(batch.query, SENTINEL)
    paged_attention_split_kv(
        batch.query, batch.kv_cache, table, qsl, seq_lens, meta.num_reqs + 1, 0.125, output, 1,
    )  # fmt: skip
    _check(batch, output, 0.125)


@pytest.mark.parametrize("num_splits", [0, MAX_NUM_SPLITS + 1])
def test_split_kv_rejects_split_counts_out_of_range(num_splits: int) -> None:
    batch = make_paged_batch([1], [10], 2, 2, 64, 4, torch.float32, device=DEVICE)
    meta = batch.metadata
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention_split_kv(
            batch.query, batch.kv_cache, meta.block_table, meta.query_start_loc, meta.seq_lens,
            meta.num_reqs, 0.125, torch.empty_like(batch.query), num_splits,
        )  # fmt: skip


@pytest.mark.parametrize(
    "launch",
    [
        KeyLoopLaunch(32, 8, 2),
        KeyLoopLaunch(128, 4, 4),
        KeyLoopLaunch(64, 8, 2, block_m=128),
        KeyLoopLaunch(64, 4, 4, block_m=32),
    ],
)
def test_other_key_loop_launches_give_the_same_attention(launch: KeyLoopLaunch) -> None:
    """The launch shapes ``benchmarks/attention_sweep.py`` times: other key tiles (32 and 128
    keys, crossing blocks of 16 differently), warps, pipeline depths, query tiles (128 rows:
    32 queries of a 4-head group, across the 6-token prefill and past it), both kernels."""
    batch = make_paged_batch([1, 1, 6], [150, 37, 90], 8, 2, 64, 16, torch.float32, device=DEVICE)
    write_step_kv(batch)
    meta = batch.metadata
    output = torch.full_like(batch.query, SENTINEL)
    paged_attention(
        batch.query, batch.kv_cache, meta.block_table, meta.query_start_loc, meta.seq_lens,
        meta.num_reqs, meta.num_actual_tokens, meta.max_query_len, 0.125, output, launch,
    )  # fmt: skip
    _check(batch, output, 0.125)
    decode = make_paged_batch([1, 1], [150, 263], 8, 2, 64, 16, torch.float32, device=DEVICE)
    write_step_kv(decode)
    meta = decode.metadata
    output = torch.full_like(decode.query, SENTINEL)
    paged_attention_split_kv(
        decode.query, decode.kv_cache, meta.block_table, meta.query_start_loc, meta.seq_lens,
        meta.num_reqs, 0.125, output, 3, launch,
    )  # fmt: skip
    _check(decode, output, 0.125)


def test_query_tile_must_hold_whole_groups() -> None:
    batch = make_paged_batch([6], [20], 8, 2, 64, 16, torch.float32, device=DEVICE)
    meta = batch.metadata
    for block_m in (8, 48):
        with pytest.raises(ValueError, match="block_m"):
            paged_attention(
                batch.query, batch.kv_cache, meta.block_table, meta.query_start_loc,
                meta.seq_lens, meta.num_reqs, meta.num_actual_tokens, meta.max_query_len, 0.125,
                torch.empty_like(batch.query), KeyLoopLaunch(block_m=block_m),
            )  # fmt: skip
