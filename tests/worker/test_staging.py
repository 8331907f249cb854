"""The step's staging buffer (one copy for every host-written array), prefix views, and the
host side of a step's batch (order, checks, staged rows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.input_batch import InputBuffers, plan_batch, stage_batch
from pagedserve.worker.prefix_views import PrefixViews
from pagedserve.worker.staging import StagedArray, StagingBuffer
from pagedserve.worker.states import RequestStates

CPU = torch.device("cpu")


def test_arrays_reach_the_device_only_with_the_copy() -> None:
    staging = StagingBuffer(
        [StagedArray("a", torch.int32, 3), StagedArray("b", torch.int64, 5)], CPU)
    staging.host["a"][:] = [1, 2, 3]
    staging.host["b"][:] = np.arange(5) * 10**10  # needs all 64 bits
    assert staging.device_views["a"].tolist() == [0, 0, 0]
    staging.copy_to_device()
    assert staging.device_views["a"].tolist() == [1, 2, 3]
    assert staging.device_views["b"].tolist() == [i * 10**10 for i in range(5)]
    assert staging.device_views["b"].dtype == torch.int64
    # Every array starts on a 64-byte boundary of one device buffer.
    base = staging.device_bytes.data_ptr()
    assert {(v.data_ptr() - base) % 64 for v in staging.device_views.values()} == {0}


def test_staged_array_names_are_unique() -> None:
    with pytest.raises(ValueError, match="unique"):
        StagingBuffer([StagedArray("a", torch.int32, 1), StagedArray("a", torch.int64, 1)], CPU)


def test_prefix_views_are_made_once_per_length() -> None:
    buffer = torch.arange(10)
    views = PrefixViews(buffer)
    assert views[3] is views[3]
    assert views[3].tolist() == [0, 1, 2]
    buffer[0] = 7  # a view, not a copy
    assert views[3][0].item() == 7


def _states_with(requests: dict[str, tuple[int, int]]) -> RequestStates:
    """requests: req_id -> (prefill length, computed tokens)."""
    states = RequestStates(8, max_model_len=64, vocab_size=16, device=CPU)
    for req_id, (prefill_len, computed) in requests.items():
        states.add_request(req_id, list(range(prefill_len)), prefill_len, computed,
                           SamplingParams())
    return states


def test_plan_puts_decodes_first_then_others_by_size() -> None:
    states = _states_with({"P9": (20, 0), "D1": (5, 5), "P3": (20, 10), "D2": (6, 6)})
    plan = plan_batch({"P9": 9, "D1": 1, "P3": 3, "D2": 1}, states)
    assert plan.req_ids == ["D1", "D2", "P3", "P9"]
    assert plan.query_lens_np.tolist() == [1, 1, 3, 9]
    assert plan.idx_mapping_np.tolist() == [states.req_id_to_index[r] for r in plan.req_ids]
    assert plan.seq_lens_np.tolist() == [6, 7, 13, 9]
    assert (plan.num_tokens, plan.max_query_len, plan.min_query_len) == (14, 9, 1)
    assert plan.num_decodes == 2  # the rows attention may run on its decode kernel
    assert plan.has_prefill and plan.uniform_decode_len is None
    assert plan.sample_rows_np.tolist() == [0, 1]  # the prefill chunks do not reach the end


def test_plan_of_decodes_keeps_the_scheduler_order() -> None:
    states = _states_with({"B": (4, 4), "A": (3, 3)})
    plan = plan_batch({"B": 1, "A": 1}, states)
    assert plan.req_ids == ["B", "A"] and not plan.has_prefill and plan.num_decodes == 2
    assert plan.uniform_decode_len == 1 and plan.sample_rows_np.tolist() == [0, 1]


def test_plan_refuses_unknown_requests_and_short_blocks() -> None:
    states = _states_with({"A": (3, 3)})
    with pytest.raises(ValueError, match=r"\['X'\] have no slot"):
        plan_batch({"A": 1, "X": 1}, states)
    plan = plan_batch({"A": 2}, states)
    num_blocks = np.zeros(8, dtype=np.int32)
    num_blocks[states.req_id_to_index["A"]] = 1  # 4 token slots for 5 tokens
    with pytest.raises(ValueError, match="needs 5 token slots, its blocks hold 4"):
        plan.check(2, 64, 64, num_blocks, 4)


def test_staged_rows_of_a_batch_with_a_partial_prefill() -> None:
    states = _states_with({"D": (5, 5), "P": (20, 0), "Q": (4, 0)})
    buffers = InputBuffers(8, 32, CPU)
    plan = plan_batch({"D": 1, "P": 6, "Q": 4}, states)  # P's chunk ends before its prompt
    query_start_loc_np = stage_batch(plan, buffers)
    assert query_start_loc_np.tolist() == [0, 1, 5, 11]  # Q (4 tokens) before P (6)
    buffers.staging.copy_to_device()
    assert buffers.query_start_loc.tolist() == [0, 1, 5, 11] + [11] * 5  # tail: num_tokens
    assert buffers.logits_indices[:3].tolist() == [0, 4, 10]
    slots = [states.req_id_to_index[r] for r in ("D", "Q")]
    assert buffers.sample_idx_mapping[:2].tolist() == slots
    assert buffers.sample_logits_indices[:2].tolist() == [0, 4]
