"""Build one step's inputs on the device: torch reference implementations
(docs/architecture.md#step-3-prepare-inputs, #step-4-block-tables-and-slot-mapping).

The CPU path and the oracle of the Triton twins in ``pagedserve/kernels/input_prep.py`` (same
signatures). Batch row ``i`` reads request state at slot ``s = idx_mapping[i]``; its tokens are
rows ``query_start_loc[i] : query_start_loc[i + 1]`` of the token buffers.

None of these functions waits for the device: they use vectorised torch ops and only host-known
ints (``num_reqs = len(idx_mapping)``, buffer sizes, ``num_tokens_padded``). Because the real
token count lives on the device, token-wise functions evaluate every row of the output buffer
and keep the old value where a row is not theirs to write (``torch.where``). Lookups use
``index_select`` rather than tensor indexing and results are written in place (``out=``,
``masked_fill_``): the same values at a fraction of the host cost, which matters because these
ops are the CPU's whole input preparation, every step.
"""

from __future__ import annotations

import torch

from pagedserve.attention.backends.base import PAD_SLOT_ID


def _token_rows(
    ends: torch.Tensor,  # int32 [num_reqs]: query_start_loc[1 : num_reqs + 1]
    num_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For token rows ``t < num_rows``: (t, batch row, is a padding row).

    Returns int32 [num_rows], int64 [num_rows], bool [num_rows]. Rows past the last request's
    end are padding; their batch row is clamped to the last request so lookups stay in bounds.
    """
    num_reqs = ends.shape[0]
    t = torch.arange(num_rows, dtype=torch.int32, device=ends.device)
    row = torch.searchsorted(ends, t, right=True)  # first request whose end is > t
    padding = row >= num_reqs
    row.clamp_(max=num_reqs - 1)
    return t, row, padding


def prepare_prefill_inputs(
    input_ids: torch.Tensor,  # int32 [max_num_tokens] (out)
    idx_mapping: torch.Tensor,  # int32 [num_reqs] batch row -> slot
    query_start_loc: torch.Tensor,  # int32 [num_reqs + 1]
    all_token_ids: torch.Tensor,  # int32 [max_num_reqs, max_model_len]
    prefill_len: torch.Tensor,  # int32 [max_num_reqs]
    num_computed_tokens: torch.Tensor,  # int32 [max_num_reqs]
) -> None:
    """Token j of row i at position ``num_computed[s] + j < prefill_len[s]`` gets
    ``all_token_ids[s, pos]``; decode tokens and padding rows are left alone."""
    num_reqs = idx_mapping.shape[0]
    if num_reqs == 0:
        return
    t, row, padding = _token_rows(query_start_loc[1 : num_reqs + 1], input_ids.shape[0])
    slot = idx_mapping.index_select(0, row)  # int32 [len(input_ids)]
    # Position of token t: t - qsl[row] + num_computed[slot].
    pos = t.sub_(query_start_loc.index_select(0, row)).add_(
        num_computed_tokens.index_select(0, slot))
    keep = padding.logical_or_(pos >= prefill_len.index_select(0, slot))  # not a prefill token
    max_model_len = all_token_ids.shape[1]
    flat = slot.long().mul_(max_model_len).add_(pos.clamp_(0, max_model_len - 1))
    tokens = torch.take(all_token_ids, flat)
    torch.where(keep, input_ids, tokens, out=input_ids)


def prepare_pos_seq_lens(
    idx_mapping: torch.Tensor,  # int32 [num_reqs]
    query_start_loc: torch.Tensor,  # int32 [num_reqs + 1]
    num_computed_tokens: torch.Tensor,  # int32 [max_num_reqs]
    positions: torch.Tensor,  # int64 [max_num_tokens] (out)
    seq_lens: torch.Tensor,  # int32 [max_num_reqs] (out)
) -> None:
    """``positions[qsl[i] + j] = num_computed[s] + j``; ``seq_lens[i] = num_computed[s] +
    query_len_i``, and 0 for entries num_reqs.. (padded requests of a FULL graph read 0)."""
    num_reqs = idx_mapping.shape[0]
    seq_lens[num_reqs:].zero_()
    if num_reqs == 0:
        return
    ends = query_start_loc[1 : num_reqs + 1]
    # Token t of row i sits at position t + first[i], first = num_computed - qsl.
    first = num_computed_tokens.index_select(0, idx_mapping).sub_(query_start_loc[:num_reqs])
    torch.add(first, ends, out=seq_lens[:num_reqs])
    t, row, padding = _token_rows(ends, positions.shape[0])
    pos = first.index_select(0, row).add_(t)  # int32 [len(positions)]
    torch.where(padding, positions, pos, out=positions)


def combine_sampled_tokens(
    input_ids: torch.Tensor,  # int32 [max_num_tokens] (in/out)
    idx_mapping: torch.Tensor,  # int32 [num_reqs]
    last_sampled_tokens: torch.Tensor,  # int64 [max_num_reqs]
    query_start_loc: torch.Tensor,  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor,  # int32 [>= num_reqs]
    prefill_len: torch.Tensor,  # int32 [max_num_reqs]
) -> None:
    """A row whose sequence runs past its prefill ends with the token sampled last step:
    ``input_ids[qsl[i + 1] - 1] = last_sampled_tokens[s]`` when ``seq_lens[i] > prefill_len[s]``."""
    num_reqs = idx_mapping.shape[0]
    if num_reqs == 0:
        return
    last = query_start_loc[1 : num_reqs + 1].long().sub_(1)  # int64 [num_reqs]: last token rows
    takes_sampled = seq_lens[:num_reqs] > prefill_len.index_select(0, idx_mapping)
    sampled = last_sampled_tokens.index_select(0, idx_mapping).to(input_ids.dtype)
    current = input_ids.index_select(0, last)
    input_ids.index_copy_(0, last, torch.where(takes_sampled, sampled, current, out=current))


def gather_block_tables(
    idx_mapping: torch.Tensor,  # int32 [num_reqs]
    block_tables: torch.Tensor,  # int32 [max_num_reqs, max_num_blocks]
    out: torch.Tensor,  # int32 [max_num_reqs, max_num_blocks] (out)
) -> None:
    """``out[i] = block_tables[idx_mapping[i]]`` for i < num_reqs; other rows untouched."""
    num_reqs = idx_mapping.shape[0]
    torch.index_select(block_tables, 0, idx_mapping, out=out[:num_reqs])


def compute_slot_mappings(
    idx_mapping: torch.Tensor,  # int32 [num_reqs]
    query_start_loc: torch.Tensor,  # int32 [num_reqs + 1]
    positions: torch.Tensor,  # int64 [max_num_tokens]
    block_tables: torch.Tensor,  # int32 [max_num_reqs, max_num_blocks], indexed by slot
    block_size: int,
    slot_mapping: torch.Tensor,  # int64 [max_num_tokens] (out)
    num_tokens_padded: int,
) -> None:
    """Token at position p of slot s: ``block_tables[s, p // block_size] * block_size +
    p % block_size``; rows ``qsl[num_reqs] .. num_tokens_padded`` get PAD_SLOT_ID."""
    num_reqs = idx_mapping.shape[0]
    out = slot_mapping[:num_tokens_padded]
    if num_reqs == 0:
        out.fill_(PAD_SLOT_ID)
        return
    _, row, padding = _token_rows(query_start_loc[1 : num_reqs + 1], num_tokens_padded)
    max_num_blocks = block_tables.shape[1]
    pos = positions[:num_tokens_padded]  # padding rows may hold anything: clamped, masked
    block_index = torch.div(pos, block_size, rounding_mode="floor").clamp_(0, max_num_blocks - 1)
    flat = block_index.add_(idx_mapping.index_select(0, row).mul_(max_num_blocks))
    block_ids = torch.take(block_tables, flat)
    torch.add(pos.remainder(block_size), block_ids, alpha=block_size, out=out)
    out.masked_fill_(padding, PAD_SLOT_ID)
