"""Logprobs are raw log_softmax of the model's logits; ranks; the top-k; prompt logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.sample import compute_prompt_logprobs
from pagedserve.sampling_params import SamplingParams
from tests.sample.sampling_helpers import add_request, batch_of, make_sampler

V = 32


def reference_rank(row: np.ndarray, token: int) -> int:
    return int((row >= row[token]).sum())


def check_logprobs(
    logits: torch.Tensor,
    token_ids: np.ndarray,
    got_ids: torch.Tensor,
    got_logprobs: torch.Tensor,
    got_ranks: torch.Tensor,
    k: int,
) -> None:
    """Column 0 is token_ids, then the k most likely; logprobs = log_softmax (fp64 reference)."""
    ref = torch.log_softmax(logits.double(), dim=-1).cpu().numpy()
    raw = logits.float().cpu().numpy()
    ids = got_ids.cpu().numpy()
    assert ids.shape == (len(token_ids), k + 1)
    np.testing.assert_array_equal(ids[:, 0], token_ids)
    for r in range(len(token_ids)):
        # The top-k by value (which of two tied tokens comes first is not specified).
        np.testing.assert_array_equal(raw[r, ids[r, 1:]], np.sort(raw[r])[::-1][:k])
        assert got_ranks[r].item() == reference_rank(raw[r], int(token_ids[r]))
    np.testing.assert_allclose(
        got_logprobs.cpu().numpy(), np.take_along_axis(ref, ids, 1), atol=1e-5
    )


def test_sampled_logprobs_are_raw_and_ranked(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(5, V, generator=gen)).to(device)
    sampler = make_sampler(8, V, device)
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.6, top_k=4, logprobs=5),  # k = 5 for the whole batch
        SamplingParams(temperature=1.2, repetition_penalty=1.8, logit_bias={0: 50.0}),
        SamplingParams(temperature=1.0, top_p=0.3, logprobs=0),
        SamplingParams(temperature=0.0, presence_penalty=2.0, logprobs=1),
    ]
    slots = [6, 0, 3, 7, 1]
    for slot, p in zip(slots, params, strict=True):
        add_request(sampler, slot, p, [0, 1, 2], [4])
    idx_mapping, idx_np = batch_of(slots, device)
    out = sampler(logits, idx_mapping, idx_np)
    assert out.logprobs is not None
    sampled = out.sampled_token_ids.cpu().numpy()
    assert sampled[2] == 0  # logit_bias changed the sample but not the (raw) logprobs
    check_logprobs(
        logits, sampled, out.logprobs.token_ids, out.logprobs.logprobs, out.logprobs.ranks, k=5
    )
    assert out.logprobs.ranks[0].item() == 1  # greedy row, no processing that moves the max
    assert out.logprobs.logprobs.dtype == torch.float32


def test_bf16_logits_are_upcast_before_log_softmax() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = (4 * torch.randn(3, V, generator=gen)).to(torch.bfloat16)
    sampler = make_sampler(3, V, torch.device("cpu"))
    for slot in range(3):
        add_request(sampler, slot, SamplingParams(logprobs=3, seed=slot), [1], [])
    idx_mapping, idx_np = batch_of([0, 1, 2], torch.device("cpu"))
    out = sampler(logits, idx_mapping, idx_np)
    assert out.logprobs is not None
    sampled = out.sampled_token_ids.numpy()
    check_logprobs(
        logits, sampled, out.logprobs.token_ids, out.logprobs.logprobs, out.logprobs.ranks, k=3
    )


def test_no_logprobs_when_no_row_asks() -> None:
    sampler = make_sampler(2, V, torch.device("cpu"))
    add_request(sampler, 0, SamplingParams(), [1], [])
    add_request(sampler, 1, SamplingParams(logprobs=2), [1], [])
    sampler.states.remove_request(1)  # what RequestStates.remove_request does
    idx_mapping, idx_np = batch_of([0], torch.device("cpu"))
    assert sampler(torch.zeros(1, V), idx_mapping, idx_np).logprobs is None


@pytest.mark.parametrize("num_logprobs", [0, 4])
def test_prompt_logprobs(device: torch.device, num_logprobs: int) -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(7, V, generator=gen).to(device)
    targets = torch.tensor([3, 3, 0, 31, 5, 9, 12], device=device)
    out = compute_prompt_logprobs(logits, targets, num_logprobs)
    check_logprobs(
        logits, targets.cpu().numpy(), out.token_ids, out.logprobs, out.ranks, k=num_logprobs
    )


def test_prompt_logprobs_rejects_mismatched_targets() -> None:
    with pytest.raises(ValueError, match="target_token_ids"):
        compute_prompt_logprobs(torch.zeros(3, V), torch.zeros(2, dtype=torch.int64), 1)
