"""The torch reference input-prep ops on a hand-made step, checked against written-out values.

Step: 3 requests over 16 slots, block size 4, padded to 12 token rows.
  row 0: slot 9, decode: 6 computed of a 6-token prompt -> position 6, the sampled token
  row 1: slot 2, prefill chunk: positions 3..6 of a 10-token prompt (crosses a block edge)
  row 2: slot 14, a new 3-token prompt: positions 0..2
Rows 8..11 are padding: they must keep their (poisoned) values, and get PAD_SLOT_ID.
"""

from __future__ import annotations

import torch

from pagedserve.attention.backends.base import PAD_SLOT_ID
from pagedserve.worker import input_prep

POISON = -7
MAX_NUM_REQS, MAX_MODEL_LEN, MAX_NUM_TOKENS, BLOCK_SIZE = 16, 12, 12, 4
IDX_MAPPING = torch.tensor([9, 2, 14], dtype=torch.int32)
QUERY_START_LOC = torch.tensor([0, 1, 5, 8], dtype=torch.int32)
NUM_TOKENS_PADDED = 12


def _slot_state() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(all_token_ids, prefill_len, num_computed_tokens); token id = 100 * slot + position."""
    pos = torch.arange(MAX_MODEL_LEN, dtype=torch.int32)
    all_token_ids = torch.arange(MAX_NUM_REQS, dtype=torch.int32)[:, None] * 100 + pos
    prefill_len = torch.zeros(MAX_NUM_REQS, dtype=torch.int32)
    num_computed = torch.full((MAX_NUM_REQS,), 5, dtype=torch.int32)  # other slots: noise
    for slot, prompt, computed in [(9, 6, 6), (2, 10, 3), (14, 3, 0)]:
        prefill_len[slot], num_computed[slot] = prompt, computed
    return all_token_ids, prefill_len, num_computed


def _poisoned(dtype: torch.dtype, n: int) -> torch.Tensor:
    return torch.full((n,), POISON, dtype=dtype)


def test_prepare_prefill_inputs_writes_prompt_tokens_only() -> None:
    all_token_ids, prefill_len, num_computed = _slot_state()
    input_ids = _poisoned(torch.int32, MAX_NUM_TOKENS)
    input_prep.prepare_prefill_inputs(input_ids, IDX_MAPPING, QUERY_START_LOC, all_token_ids,
                                      prefill_len, num_computed)
    expected = [POISON, 203, 204, 205, 206, 1400, 1401, 1402] + [POISON] * 4
    assert input_ids.tolist() == expected


def test_prepare_pos_seq_lens() -> None:
    _, _, num_computed = _slot_state()
    positions = _poisoned(torch.int64, MAX_NUM_TOKENS)
    seq_lens = _poisoned(torch.int32, MAX_NUM_REQS)
    input_prep.prepare_pos_seq_lens(IDX_MAPPING, QUERY_START_LOC, num_computed, positions,
                                    seq_lens)
    assert positions.tolist() == [6, 3, 4, 5, 6, 0, 1, 2] + [POISON] * 4
    assert seq_lens.tolist() == [7, 7, 3] + [0] * (MAX_NUM_REQS - 3)


def test_combine_sampled_tokens_only_past_the_prefill() -> None:
    _, prefill_len, _ = _slot_state()
    input_ids = _poisoned(torch.int32, MAX_NUM_TOKENS)
    last_sampled = torch.arange(MAX_NUM_REQS, dtype=torch.int64) + 5000
    seq_lens = torch.tensor([7, 7, 3], dtype=torch.int32)
    input_prep.combine_sampled_tokens(input_ids, IDX_MAPPING, last_sampled, QUERY_START_LOC,
                                      seq_lens, prefill_len)
    # Only row 0 (seq_len 7 > prefill 6) takes its sampled token, at its last row (row 0).
    assert input_ids.tolist() == [5009] + [POISON] * 11


def test_gather_block_tables_in_batch_order() -> None:
    block_tables = torch.arange(MAX_NUM_REQS * 3, dtype=torch.int32).view(MAX_NUM_REQS, 3)
    out = torch.full((MAX_NUM_REQS, 3), POISON, dtype=torch.int32)
    input_prep.gather_block_tables(IDX_MAPPING, block_tables, out)
    assert out[:3].tolist() == [[27, 28, 29], [6, 7, 8], [42, 43, 44]]
    assert (out[3:] == POISON).all()


def test_compute_slot_mappings_crosses_blocks_and_pads() -> None:
    max_num_blocks = MAX_MODEL_LEN // BLOCK_SIZE
    block_tables = torch.zeros(MAX_NUM_REQS, max_num_blocks, dtype=torch.int32)
    block_tables[9] = torch.tensor([7, 3, 0], dtype=torch.int32)
    block_tables[2] = torch.tensor([11, 5, 0], dtype=torch.int32)
    block_tables[14] = torch.tensor([20, 0, 0], dtype=torch.int32)
    positions = torch.tensor([6, 3, 4, 5, 6, 0, 1, 2] + [999] * 4, dtype=torch.int64)
    slot_mapping = _poisoned(torch.int64, MAX_NUM_TOKENS + 4)
    input_prep.compute_slot_mappings(IDX_MAPPING, QUERY_START_LOC, positions, block_tables,
                                     BLOCK_SIZE, slot_mapping, NUM_TOKENS_PADDED)
    expected = [
        3 * 4 + 2,  # slot 9, position 6: block index 1 (id 3), offset 2
        11 * 4 + 3, 5 * 4 + 0, 5 * 4 + 1, 5 * 4 + 2,  # slot 2, positions 3..6 across blocks
        20 * 4 + 0, 20 * 4 + 1, 20 * 4 + 2,  # slot 14, positions 0..2
    ] + [PAD_SLOT_ID] * 4 + [POISON] * 4  # padding rows; beyond num_tokens_padded untouched
    assert slot_mapping.tolist() == expected


def test_single_request_filling_the_buffer_has_no_padding() -> None:
    all_token_ids, prefill_len, num_computed = _slot_state()
    prefill_len[3], num_computed[3] = 12, 0
    idx_mapping = torch.tensor([3], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 12], dtype=torch.int32)
    input_ids = _poisoned(torch.int32, MAX_NUM_TOKENS)
    input_prep.prepare_prefill_inputs(input_ids, idx_mapping, query_start_loc, all_token_ids,
                                      prefill_len, num_computed)
    assert input_ids.tolist() == [300 + p for p in range(12)]
