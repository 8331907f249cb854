"""Triton kernels that build one step's inputs on the device.

docs/architecture.md#step-3-prepare-inputs and #step-4-block-tables-and-slot-mapping.

Twins of the torch reference functions in ``pagedserve/worker/input_prep.py``, with the same
signatures. Every function writes into preallocated buffers and launches with grid sizes taken
from host-known ints only (``num_reqs = len(idx_mapping)``, ``num_tokens_padded``), so none of
them waits for the device. Batch row ``i`` reads request state at slot ``idx_mapping[i]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.attention.backends.base import PAD_SLOT_ID

# Elements one program handles per loop iteration.
_BLOCK = 1024


@triton.jit
def _prepare_prefill_inputs_kernel(
    input_ids_ptr,  # int32 [max_num_tokens]
    idx_mapping_ptr,  # int32 [num_reqs]
    query_start_loc_ptr,  # int32 [num_reqs + 1]
    all_token_ids_ptr,  # int32 [max_num_reqs, max_model_len]
    all_token_ids_stride,
    prefill_len_ptr,  # int32 [max_num_reqs]
    num_computed_tokens_ptr,  # int32 [max_num_reqs]
    BLOCK: tl.constexpr,
):
    batch_idx = tl.program_id(0)
    slot = tl.load(idx_mapping_ptr + batch_idx)
    prefill_len = tl.load(prefill_len_ptr + slot)
    num_computed = tl.load(num_computed_tokens_ptr + slot)
    query_start = tl.load(query_start_loc_ptr + batch_idx)
    query_len = tl.load(query_start_loc_ptr + batch_idx + 1) - query_start
    # Only tokens still inside the prompt come from all_token_ids; the rest are sampled tokens.
    num_prefill = tl.minimum(query_len, prefill_len - num_computed)
    row_ptr = all_token_ids_ptr + slot.to(tl.int64) * all_token_ids_stride + num_computed
    for start in range(0, num_prefill, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < num_prefill
        tokens = tl.load(row_ptr + offs, mask=mask)
        tl.store(input_ids_ptr + query_start + offs, tokens, mask=mask)


def prepare_prefill_inputs(
    input_ids: torch.Tensor,  # int32 [max_num_tokens] (out)
    idx_mapping: torch.Tensor,  # int32 [num_reqs]
    query_start_loc: torch.Tensor,  # int32 [num_reqs + 1]
    all_token_ids: torch.Tensor,  # int32 [max_num_reqs, max_model_len]
    prefill_len: torch.Tensor,  # int32 [max_num_reqs]
    num_computed_tokens: torch.Tensor,  # int32 [max_num_reqs]
) -> None:
    """Copy each row's prompt tokens ``all_token_ids[s, num_computed[s] + j]`` into input_ids."""
    num_reqs = idx_mapping.shape[0]
    if num_reqs == 0:
        return
    _prepare_prefill_inputs_kernel[(num_reqs,)](
        input_ids,
        idx_mapping,
        query_start_loc,
        all_token_ids,
        all_token_ids.stride(0),
        prefill_len,
        num_computed_tokens,
        BLOCK=_BLOCK,
    )


@triton.jit(do_not_specialize=["num_reqs"])  # per-step ints: kernels/__init__
def _prepare_pos_seq_lens_kernel(
    idx_mapping_ptr,  # int32 [num_reqs]
    query_start_loc_ptr,  # int32 [num_reqs + 1]
    num_computed_tokens_ptr,  # int32 [max_num_reqs]
    positions_ptr,  # int64 [max_num_tokens]
    seq_lens_ptr,  # int32 [max_num_reqs]
    num_reqs,
    max_num_reqs,
    BLOCK: tl.constexpr,
):
    batch_idx = tl.program_id(0)
    if batch_idx == num_reqs:
        # The extra program zeroes seq_lens of the unused rows (read by full CUDA graphs).
        for start in range(num_reqs, max_num_reqs, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            tl.store(seq_lens_ptr + offs, tl.zeros([BLOCK], tl.int32), mask=offs < max_num_reqs)
        return
    slot = tl.load(idx_mapping_ptr + batch_idx)
    num_computed = tl.load(num_computed_tokens_ptr + slot)
    query_start = tl.load(query_start_loc_ptr + batch_idx)
    query_len = tl.load(query_start_loc_ptr + batch_idx + 1) - query_start
    tl.store(seq_lens_ptr + batch_idx, num_computed + query_len)
    for start in range(0, query_len, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        positions = (num_computed + offs).to(tl.int64)
        tl.store(positions_ptr + query_start + offs, positions, mask=offs < query_len)


def prepare_pos_seq_lens(
    idx_mapping: torch.Tensor,  # int32 [num_reqs]
    query_start_loc: torch.Tensor,  # int32 [num_reqs + 1]
    num_computed_tokens: torch.Tensor,  # int32 [max_num_reqs]
    positions: torch.Tensor,  # int64 [max_num_tokens] (out)
    seq_lens: torch.Tensor,  # int32 [max_num_reqs] (out)
) -> None:
    """positions of row i = num_computed[s] + j; seq_lens[i] = num_computed[s] + query_len_i;
    seq_lens[num_reqs:] = 0."""
    num_reqs = idx_mapping.shape[0]
    _prepare_pos_seq_lens_kernel[(num_reqs + 1,)](
        idx_mapping,
        query_start_loc,
        num_computed_tokens,
        positions,
        seq_lens,
        num_reqs,
        seq_lens.shape[0],
        BLOCK=_BLOCK,
    )


@triton.jit
def _combine_sampled_tokens_kernel(
    input_ids_ptr,  # int32 [max_num_tokens]
    idx_mapping_ptr,  # int32 [num_reqs]
    last_sampled_tokens_ptr,  # int64 [max_num_reqs]
    query_start_loc_ptr,  # int32 [num_reqs + 1]
    seq_lens_ptr,  # int32 [num_reqs]
    prefill_len_ptr,  # int32 [max_num_reqs]
):
    batch_idx = tl.program_id(0)
    slot = tl.load(idx_mapping_ptr + batch_idx)
    seq_len = tl.load(seq_lens_ptr + batch_idx)
    prefill_len = tl.load(prefill_len_ptr + slot)
    query_start = tl.load(query_start_loc_ptr + batch_idx)
    query_end = tl.load(query_start_loc_ptr + batch_idx + 1)
    # A row past its prompt feeds the token sampled last step; an empty row owns no input row.
    if (seq_len > prefill_len) & (query_end > query_start):
        token = tl.load(last_sampled_tokens_ptr + slot)
        tl.store(input_ids_ptr + query_end - 1, token.to(tl.int32))


def combine_sampled_tokens(
    input_ids: torch.Tensor,  # int32 [max_num_tokens] (in/out)
    idx_mapping: torch.Tensor,  # int32 [num_reqs]
    last_sampled_tokens: torch.Tensor,  # int64 [max_num_reqs]
    query_start_loc: torch.Tensor,  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor,  # int32 [>= num_reqs]
    prefill_len: torch.Tensor,  # int32 [max_num_reqs]
) -> None:
    """Row i past its prompt: input_ids[qsl[i + 1] - 1] = last_sampled_tokens[s]."""
    num_reqs = idx_mapping.shape[0]
    if num_reqs == 0:
        return
    _combine_sampled_tokens_kernel[(num_reqs,)](
        input_ids, idx_mapping, last_sampled_tokens, query_start_loc, seq_lens, prefill_len
    )


@triton.jit
def _gather_block_tables_kernel(
    idx_mapping_ptr,  # int32 [num_reqs]
    block_tables_ptr,  # int32 [max_num_reqs, max_num_blocks]
    block_tables_stride,
    out_ptr,  # int32 [max_num_reqs, max_num_blocks]
    out_stride,
    max_num_blocks,
    BLOCK: tl.constexpr,
):
    batch_idx = tl.program_id(0)
    slot = tl.load(idx_mapping_ptr + batch_idx)
    src_row = block_tables_ptr + slot.to(tl.int64) * block_tables_stride
    dst_row = out_ptr + batch_idx.to(tl.int64) * out_stride
    for start in range(0, max_num_blocks, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < max_num_blocks
        tl.store(dst_row + offs, tl.load(src_row + offs, mask=mask), mask=mask)


def gather_block_tables(
    idx_mapping: torch.Tensor,  # int32 [num_reqs]
    block_tables: torch.Tensor,  # int32 [max_num_reqs, max_num_blocks]
    out: torch.Tensor,  # int32 [max_num_reqs, max_num_blocks] (out)
) -> None:
    """out[i] = block_tables[idx_mapping[i]] for i < num_reqs (the block tables in batch order)."""
    num_reqs = idx_mapping.shape[0]
    if out.shape[1] != block_tables.shape[1]:
        raise ValueError(
            f"out: {out.shape[1]} columns, block_tables has {block_tables.shape[1]}"
        )
    if num_reqs == 0:
        return
    _gather_block_tables_kernel[(num_reqs,)](
        idx_mapping,
        block_tables,
        block_tables.stride(0),
        out,
        out.stride(0),
        block_tables.shape[1],
        BLOCK=_BLOCK,
    )


@triton.jit(do_not_specialize=["num_reqs", "num_tokens_padded"])  # per-step ints: kernels/__init__
def _compute_slot_mappings_kernel(
    idx_mapping_ptr,  # int32 [num_reqs]
    query_start_loc_ptr,  # int32 [num_reqs + 1]
    positions_ptr,  # int64 [max_num_tokens]
    block_tables_ptr,  # int32 [max_num_reqs, max_num_blocks]
    block_tables_stride,
    slot_mapping_ptr,  # int64 [max_num_tokens]
    num_reqs,
    num_tokens_padded,
    BLOCK_SIZE: tl.constexpr,
    PAD_ID: tl.constexpr,
    BLOCK: tl.constexpr,
):
    batch_idx = tl.program_id(0)
    if batch_idx == num_reqs:
        # The extra program marks the padding tokens so their cache writes are skipped.
        num_tokens = tl.load(query_start_loc_ptr + num_reqs)
        for start in range(0, num_tokens_padded, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            pad = tl.full([BLOCK], PAD_ID, tl.int64)
            is_pad = (offs >= num_tokens) & (offs < num_tokens_padded)
            tl.store(slot_mapping_ptr + offs, pad, mask=is_pad)
        return
    slot = tl.load(idx_mapping_ptr + batch_idx)
    table_row = block_tables_ptr + slot.to(tl.int64) * block_tables_stride
    query_start = tl.load(query_start_loc_ptr + batch_idx)
    query_len = tl.load(query_start_loc_ptr + batch_idx + 1) - query_start
    for start in range(0, query_len, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < query_len
        positions = tl.load(positions_ptr + query_start + offs, mask=mask, other=0)
        block_ids = tl.load(table_row + positions // BLOCK_SIZE, mask=mask, other=0)
        slots = block_ids.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE
        tl.store(slot_mapping_ptr + query_start + offs, slots, mask=mask)


def compute_slot_mappings(
    idx_mapping: torch.Tensor,  # int32 [num_reqs]
    query_start_loc: torch.Tensor,  # int32 [num_reqs + 1]
    positions: torch.Tensor,  # int64 [max_num_tokens]
    block_tables: torch.Tensor,  # int32 [max_num_reqs, max_num_blocks], indexed by slot
    block_size: int,
    slot_mapping: torch.Tensor,  # int64 [max_num_tokens] (out)
    num_tokens_padded: int,
) -> None:
    """Cache slot of every token (block id x block_size + offset); tokens from
    ``query_start_loc[num_reqs]`` up to ``num_tokens_padded`` get PAD_SLOT_ID."""
    if num_tokens_padded > slot_mapping.shape[0]:
        raise ValueError(
            f"num_tokens_padded: {num_tokens_padded} exceeds the slot_mapping size "
            f"{slot_mapping.shape[0]}"
        )
    num_reqs = idx_mapping.shape[0]
    _compute_slot_mappings_kernel[(num_reqs + 1,)](
        idx_mapping,
        query_start_loc,
        positions,
        block_tables,
        block_tables.stride(0),
        slot_mapping,
        num_reqs,
        num_tokens_padded,
        BLOCK_SIZE=block_size,
        PAD_ID=PAD_SLOT_ID,
        BLOCK=_BLOCK,
    )
