"""Build one step's inputs on the device: torch reference implementations (stops 3 and 4).

The CPU path and the oracle of the Triton twins in ``pagedserve/kernels/input_prep.py`` (same
signatures). Batch row ``i`` reads request state at slot ``s = idx_mapping[i]``; its tokens are
rows ``query_start_loc[i] : query_start_loc[i + 1]`` of the token buffers.

None of these functions waits for the device: they use vectorised torch ops and only host-known
ints (``num_reqs = len(idx_mapping)``, buffer sizes, ``num_tokens_padded``). Because the real
token count lives on the device, token-wise functions evaluate every row of the output buffer
and keep the old value where a row is not theirs to write (``torch.where``).
"""

from __future__ import annotations

import torch

from pagedserve.attention.backends.base import PAD_SLOT_ID


def _token_rows(
    query_start_loc: torch.Tensor,  # int32 [>= num_reqs + 1]
    num_reqs: int,
    num_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For token rows ``t < num_rows``: (batch row, offset in its request, is a real token).

    Returns int64 [num_rows], int64 [num_rows], bool [num_rows]. Rows past the last request's
    end are padding; their batch row is clamped to the last request so lookups stay in bounds.
    """
    t = torch.arange(num_rows, dtype=torch.int32, device=query_start_loc.device)
    ends = query_start_loc[1 : num_reqs + 1].contiguous()  # int32 [num_reqs]
    row = torch.searchsorted(ends, t, right=True)  # first request whose end is > t
    valid = row < num_reqs
    row = row.clamp(max=num_reqs - 1)
    offset = (t - query_start_loc[row]).long()
    return row, offset, valid


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
    row, offset, valid = _token_rows(query_start_loc, num_reqs, input_ids.shape[0])
    slot = idx_mapping.long()[row]  # int64 [max_num_tokens]
    pos = num_computed_tokens[slot].long() + offset
    is_prefill = valid & (pos < prefill_len[slot])
    tokens = all_token_ids[slot, pos.clamp(0, all_token_ids.shape[1] - 1)]
    input_ids.copy_(torch.where(is_prefill, tokens, input_ids))


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
    seq_lens[num_reqs:] = 0
    if num_reqs == 0:
        return
    slots = idx_mapping.long()  # int64 [num_reqs]
    qsl = query_start_loc[: num_reqs + 1]
    seq_lens[:num_reqs] = num_computed_tokens[slots] + (qsl[1:] - qsl[:-1])
    row, offset, valid = _token_rows(qsl, num_reqs, positions.shape[0])
    pos = num_computed_tokens[slots[row]].long() + offset  # int64 [max_num_tokens]
    positions.copy_(torch.where(valid, pos, positions))


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
    slots = idx_mapping.long()
    last = query_start_loc[1 : num_reqs + 1].long() - 1  # int64 [num_reqs]
    takes_sampled = seq_lens[:num_reqs] > prefill_len[slots]
    sampled = last_sampled_tokens[slots].to(input_ids.dtype)
    input_ids[last] = torch.where(takes_sampled, sampled, input_ids[last])


def gather_block_tables(
    idx_mapping: torch.Tensor,  # int32 [num_reqs]
    block_tables: torch.Tensor,  # int32 [max_num_reqs, max_num_blocks]
    out: torch.Tensor,  # int32 [max_num_reqs, max_num_blocks] (out)
) -> None:
    """``out[i] = block_tables[idx_mapping[i]]`` for i < num_reqs; other rows untouched."""
    num_reqs = idx_mapping.shape[0]
    out[:num_reqs] = block_tables.index_select(0, idx_mapping)


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
    if num_reqs == 0:
        slot_mapping[:num_tokens_padded] = PAD_SLOT_ID
        return
    row, _, valid = _token_rows(query_start_loc, num_reqs, num_tokens_padded)
    slot = idx_mapping.long()[row]  # int64 [num_tokens_padded]
    pos = positions[:num_tokens_padded].clamp(min=0)
    block_index = (pos // block_size).clamp(max=block_tables.shape[1] - 1)
    block_ids = block_tables[slot, block_index].long()
    cache_slots = block_ids * block_size + pos % block_size
    slot_mapping[:num_tokens_padded] = torch.where(valid, cache_slots, PAD_SLOT_ID)
