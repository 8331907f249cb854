"""Request slots (handed out from the top) and block tables with staged writes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.platform.base import torch_input_prep_ops
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.block_table import BlockTables
from pagedserve.worker.states import RequestStates

CPU = torch.device("cpu")


def _states(max_num_reqs: int = 1024) -> RequestStates:
    return RequestStates(max_num_reqs, max_model_len=32, vocab_size=16, device=CPU)


def test_slots_are_handed_out_from_the_top() -> None:
    states = _states()
    slots = [states.add_request(r, [1, 2, 3], 3, 0, SamplingParams()) for r in ("R1", "R2", "R3")]
    assert slots == [1023, 1022, 1021]
    assert states.req_id_to_index == {"R1": 1023, "R2": 1022, "R3": 1021}
    assert states.remove_request("R2") == 1022
    assert states.add_request("R4", [5], 1, 0, SamplingParams()) == 1022  # freed slot reused
    assert states.remove_request("unknown") is None


def test_add_request_stores_prefill_and_counts() -> None:
    states = _states(4)
    slot = states.add_request("R", [7, 8, 9, 10, 11], num_prompt_tokens=3,
                              num_computed_tokens=2, sampling_params=SamplingParams())
    states.apply_staged_writes()
    assert states.all_token_ids[slot, :5].tolist() == [7, 8, 9, 10, 11]
    assert states.prefill_len[slot].item() == 5
    assert states.num_computed_tokens[slot].item() == 2
    assert states.num_resumed_output_tokens_np[slot] == 2  # resumed after preemption
    assert states.sampling.num_output_tokens[slot].item() == 2  # the sampler's counter too
    states.set_num_computed_tokens("R", 5)
    assert states.num_computed_tokens[slot].item() == 2  # device twin waits for the copy
    states.apply_staged_writes()
    assert states.num_computed_tokens[slot].item() == 5


def test_bad_requests_are_refused() -> None:
    states = _states(1)
    with pytest.raises(ValueError, match="prefill_token_ids"):
        states.add_request("long", list(range(33)), 33, 0, SamplingParams())
    states.add_request("A", [1], 1, 0, SamplingParams())
    with pytest.raises(ValueError, match="already owns"):
        states.add_request("A", [1], 1, 0, SamplingParams())
    with pytest.raises(ValueError, match="max_num_seqs"):
        states.add_request("B", [1], 1, 0, SamplingParams())
    with pytest.raises(ValueError, match="has no slot"):
        states.set_num_computed_tokens("B", 1)
    with pytest.raises(ValueError, match="'B' has no slot"):
        states.set_num_computed_tokens_batch(["A", "B"], [1, 1])


def test_counts_of_many_requests_are_set_at_once() -> None:
    states = _states(4)
    for r in ("A", "B", "C"):
        states.add_request(r, [1, 2, 3], 3, 0, SamplingParams(logprobs=2 if r == "B" else None))
    slots = states.set_num_computed_tokens_batch(["C", "A"], [3, 2])
    assert slots.tolist() == [states.req_id_to_index["C"], states.req_id_to_index["A"]]
    states.apply_staged_writes()
    assert states.num_computed_tokens[slots].tolist() == [3, 2]
    b = states.req_id_to_index["B"]
    assert states.sampling.num_logprobs_np[b] == 2 and states.num_computed_tokens[b].item() == 0
    states.remove_request("B")
    assert states.sampling.num_logprobs_np[b] == -1  # a free slot asks for nothing


def test_sampling_columns_travel_with_the_counts_in_one_copy() -> None:
    states = _states(4)
    params = SamplingParams(temperature=0.5, top_k=3, seed=7, frequency_penalty=0.25)
    slot = states.add_request("R", [1, 2], 2, 0, params)
    sampling = states.sampling
    assert sampling.temperature[slot].item() == 0.0  # on the host only, until the copy
    states.staging.copy_to_device()
    assert sampling.temperature[slot].item() == 0.5 and sampling.top_k[slot].item() == 3
    assert sampling.seeds[slot].item() == 7 and sampling.frequency_penalty[slot].item() == 0.25
    assert states.prefill_len[slot].item() == 2
    assert sampling.staging is states.staging


def _tables() -> BlockTables:
    return BlockTables(max_num_reqs=4, max_model_len=32, max_num_tokens=16, block_size=4,
                       device=CPU, ops=torch_input_prep_ops())


def _apply(tables: BlockTables) -> None:
    """What the runner does each step: the staging copy, then the scatter."""
    tables.staging.copy_to_device()
    tables.apply_staged_writes()


def test_block_table_writes_are_staged_until_applied() -> None:
    tables = _tables()
    tables.overwrite_row(3, [5, 6])
    tables.append_block_ids(3, [9])
    tables.overwrite_row(1, [2])
    assert tables.num_staged_entries == 4  # staged as (flat index, block id) pairs
    tables.staging.copy_to_device()
    assert tables.block_table.abs().sum().item() == 0  # nothing in the table until applied
    tables.apply_staged_writes()
    assert tables.block_table[3, :3].tolist() == [5, 6, 9]
    assert tables.block_table[1, :1].tolist() == [2]
    assert tables.num_blocks_np.tolist() == [0, 1, 0, 3]
    assert tables.num_staged_entries == 0
    # A new request in a reused slot overwrites the row from the start.
    tables.overwrite_row(3, [7])
    _apply(tables)
    assert tables.block_table[3, 0].item() == 7 and tables.num_blocks_np[3] == 1


def test_block_table_writes_beyond_the_staging_capacity_travel_as_rows() -> None:
    # Capacity: max_num_reqs + max_num_tokens / block_size = 4 + 4 = 8 entries.
    tables = _tables()
    tables.overwrite_row(0, [1, 2, 3, 4, 5, 6])  # 6 entries
    tables.overwrite_row(2, [7, 8, 9])  # does not fit: the whole row goes
    tables.append_block_ids(0, [10, 11])  # still fits: entries 7 and 8
    tables.append_block_ids(2, [12])  # its row travels already: no entry
    assert tables.num_staged_entries == 8
    _apply(tables)
    assert tables.block_table[0].tolist() == [1, 2, 3, 4, 5, 6, 10, 11]
    assert tables.block_table[2, :4].tolist() == [7, 8, 9, 12]
    # The next step starts empty again.
    tables.append_block_ids(2, [13])
    assert tables.num_staged_entries == 1
    _apply(tables)
    assert tables.block_table[2, :5].tolist() == [7, 8, 9, 12, 13]


def test_block_table_row_cannot_outgrow_max_model_len() -> None:
    tables = _tables()
    with pytest.raises(ValueError, match="block_ids"):
        tables.overwrite_row(0, list(range(9)))  # 32 / 4 = 8 blocks at most


def test_gather_and_slot_mapping_through_block_tables() -> None:
    tables = _tables()
    tables.overwrite_row(2, [4, 8])
    tables.overwrite_row(0, [1])
    _apply(tables)
    idx_mapping = torch.tensor([2, 0], dtype=torch.int32)
    gathered = tables.gather_block_tables(idx_mapping, num_reqs_padded=2)
    assert gathered[:, :2].tolist() == [[4, 8], [1, tables.block_table[0, 1].item()]]
    query_start_loc = torch.tensor([0, 2, 3], dtype=torch.int32)
    positions = torch.zeros(16, dtype=torch.int64)
    positions[:3] = torch.tensor([3, 4, 0])
    slot_mapping = tables.compute_slot_mappings(idx_mapping, query_start_loc, positions, 4)
    assert slot_mapping.tolist() == [4 * 4 + 3, 8 * 4 + 0, 1 * 4 + 0, -1]
    assert np.array_equal(tables.num_blocks_np[[2, 0]], [2, 1])
