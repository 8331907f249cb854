"""Input-preparation kernels against the torch reference (pagedserve.worker.input_prep) and an
explicit per-token expectation, on poisoned buffers. The tensors live on the CPU; the Triton
kernels run on the GPU where there is one (``on_kernel_device``), else under the interpreter."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from kernel_device import on_kernel_device

import pagedserve.worker.input_prep as ref
from pagedserve.attention.backends.base import PAD_SLOT_ID
from pagedserve.kernels import input_prep as tri

POISON = -7
MAX_NUM_REQS, MAX_MODEL_LEN, MAX_NUM_TOKENS, BLOCK_SIZE = 8, 40, 32, 4


@dataclass
class Step:
    idx_mapping: torch.Tensor  # int32 [num_reqs]
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    all_token_ids: torch.Tensor  # int32 [MAX_NUM_REQS, MAX_MODEL_LEN]
    prefill_len: torch.Tensor  # int32 [MAX_NUM_REQS]
    num_computed_tokens: torch.Tensor  # int32 [MAX_NUM_REQS]
    last_sampled_tokens: torch.Tensor  # int64 [MAX_NUM_REQS]
    block_tables: torch.Tensor  # int32 [MAX_NUM_REQS, MAX_MODEL_LEN // BLOCK_SIZE]
    query_lens: list[int]


@pytest.fixture
def step() -> Step:
    """Rows: a decode (slot 5), a prefill chunk crossing block edges (slot 2), a whole new
    prompt (slot 7), and a row running past its prompt's end (slot 0)."""
    slots, query_lens = [5, 2, 7, 0], [1, 9, 6, 3]
    prefill_len = torch.randint(1, 30, (MAX_NUM_REQS,), dtype=torch.int32)
    num_computed = torch.randint(0, 20, (MAX_NUM_REQS,), dtype=torch.int32)
    for slot, prompt, computed in [(5, 8, 11), (2, 20, 3), (7, 6, 0), (0, 10, 8)]:
        prefill_len[slot], num_computed[slot] = prompt, computed
    max_num_blocks = MAX_MODEL_LEN // BLOCK_SIZE
    return Step(
        idx_mapping=torch.tensor(slots, dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 10, 16, 19], dtype=torch.int32),
        all_token_ids=torch.randint(0, 1000, (MAX_NUM_REQS, MAX_MODEL_LEN), dtype=torch.int32),
        prefill_len=prefill_len,
        num_computed_tokens=num_computed,
        last_sampled_tokens=torch.randint(1000, 2000, (MAX_NUM_REQS,), dtype=torch.int64),
        block_tables=torch.randperm(MAX_NUM_REQS * max_num_blocks).int().view(MAX_NUM_REQS, -1),
        query_lens=query_lens,
    )


def _rows(step: Step):
    """(batch row, slot, first token row, query_len) of every request."""
    for i, (slot, qlen) in enumerate(zip(step.idx_mapping.tolist(), step.query_lens, strict=True)):
        yield i, slot, step.query_start_loc[i].item(), qlen


def _poisoned(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.full(shape, POISON, dtype=dtype)


def test_prepare_prefill_inputs(step: Step) -> None:
    args = (
        step.idx_mapping, step.query_start_loc, step.all_token_ids, step.prefill_len,
        step.num_computed_tokens,
    )  # fmt: skip
    out, out_ref = _poisoned(torch.int32, MAX_NUM_TOKENS), _poisoned(torch.int32, MAX_NUM_TOKENS)
    on_kernel_device(tri.prepare_prefill_inputs, out, *args)
    ref.prepare_prefill_inputs(out_ref, *args)
    expected = _poisoned(torch.int32, MAX_NUM_TOKENS)
    for _, slot, start, qlen in _rows(step):
        for j in range(qlen):
            pos = step.num_computed_tokens[slot].item() + j
            if pos < step.prefill_len[slot]:
                expected[start + j] = step.all_token_ids[slot, pos]
    assert torch.equal(out, expected)
    assert torch.equal(out, out_ref)


def test_prepare_pos_seq_lens(step: Step) -> None:
    results = []
    for impl in (tri, ref):
        positions = _poisoned(torch.int64, MAX_NUM_TOKENS)
        seq_lens = _poisoned(torch.int32, MAX_NUM_REQS)
        on_kernel_device(
            impl.prepare_pos_seq_lens, step.idx_mapping, step.query_start_loc,
            step.num_computed_tokens, positions, seq_lens,
        )  # fmt: skip
        results.append((positions, seq_lens))
    positions = _poisoned(torch.int64, MAX_NUM_TOKENS)
    seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.int32)
    for i, slot, start, qlen in _rows(step):
        computed = step.num_computed_tokens[slot].item()
        positions[start : start + qlen] = torch.arange(computed, computed + qlen)
        seq_lens[i] = computed + qlen
    for got_positions, got_seq_lens in results:
        assert torch.equal(got_positions, positions)  # padding rows 19.. keep the poison
        assert torch.equal(got_seq_lens, seq_lens)  # entries num_reqs.. are zeroed


def test_combine_sampled_tokens(step: Step) -> None:
    slots = step.idx_mapping.long()
    seq_lens = step.num_computed_tokens[slots] + torch.tensor(step.query_lens, dtype=torch.int32)
    args = (
        step.idx_mapping, step.last_sampled_tokens, step.query_start_loc, seq_lens,
        step.prefill_len,
    )  # fmt: skip
    start_ids = torch.randint(0, 1000, (MAX_NUM_TOKENS,), dtype=torch.int32)
    out, out_ref = start_ids.clone(), start_ids.clone()
    on_kernel_device(tri.combine_sampled_tokens, out, *args)
    ref.combine_sampled_tokens(out_ref, *args)
    expected = start_ids.clone()
    for i, slot, start, qlen in _rows(step):
        if seq_lens[i] > step.prefill_len[slot]:
            expected[start + qlen - 1] = step.last_sampled_tokens[slot]
    assert not torch.equal(expected, start_ids), "the step must have rows taking sampled tokens"
    assert torch.equal(out, expected)
    assert torch.equal(out, out_ref)


def test_gather_block_tables(step: Step) -> None:
    shape = step.block_tables.shape
    out, out_ref = _poisoned(torch.int32, *shape), _poisoned(torch.int32, *shape)
    on_kernel_device(tri.gather_block_tables, step.idx_mapping, step.block_tables, out)
    ref.gather_block_tables(step.idx_mapping, step.block_tables, out_ref)
    expected = _poisoned(torch.int32, *shape)
    expected[:4] = step.block_tables[step.idx_mapping.long()]
    assert torch.equal(out, expected)
    assert torch.equal(out, out_ref)


@pytest.mark.parametrize("num_tokens_padded", [19, 24])
def test_compute_slot_mappings(step: Step, num_tokens_padded: int) -> None:
    positions = _poisoned(torch.int64, MAX_NUM_TOKENS)
    ref.prepare_pos_seq_lens(
        step.idx_mapping, step.query_start_loc, step.num_computed_tokens, positions,
        _poisoned(torch.int32, MAX_NUM_REQS),
    )  # fmt: skip
    args = (step.idx_mapping, step.query_start_loc, positions, step.block_tables, BLOCK_SIZE)
    out, out_ref = _poisoned(torch.int64, MAX_NUM_TOKENS), _poisoned(torch.int64, MAX_NUM_TOKENS)
    on_kernel_device(tri.compute_slot_mappings, *args, out, num_tokens_padded)
    ref.compute_slot_mappings(*args, out_ref, num_tokens_padded)
    expected = _poisoned(torch.int64, MAX_NUM_TOKENS)
    expected[19:num_tokens_padded] = PAD_SLOT_ID
    for _, slot, start, qlen in _rows(step):
        for t in range(start, start + qlen):
            pos = positions[t].item()
            block_id = step.block_tables[slot, pos // BLOCK_SIZE].item()
            expected[t] = block_id * BLOCK_SIZE + pos % BLOCK_SIZE
    assert torch.equal(out, expected)  # rows past num_tokens_padded keep the poison
    assert torch.equal(out, out_ref)


def test_compute_slot_mappings_rejects_oversized_padding(step: Step) -> None:
    with pytest.raises(ValueError, match="num_tokens_padded"):
        tri.compute_slot_mappings(
            step.idx_mapping, step.query_start_loc, torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64),
            step.block_tables, BLOCK_SIZE, torch.zeros(8, dtype=torch.int64), 9,
        )  # fmt: skip
