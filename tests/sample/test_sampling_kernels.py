"""The Triton sampling path against the torch reference: interpreted on the CPU
(TRITON_INTERPRET=1), compiled where CUDA is available.

Same noise, same tokens: the fused pass must pick exactly the reference's token, and the
truncation kernel must keep exactly the tokens the reference keeps (min-p, top-k, top-p, ties).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from pagedserve.kernels.sampling_common import kept_mask  # noqa: E402
from pagedserve.kernels.sampling_gumbel import gumbel_sample  # noqa: E402
from pagedserve.kernels.sampling_truncation import truncation_cuts  # noqa: E402
from pagedserve.sample import Sampler  # noqa: E402
from pagedserve.sample.token_sampler import TorchTokenSampler, truncate  # noqa: E402
from pagedserve.sample.triton_token_sampler import (  # noqa: E402
    NOISE_HASH,
    TritonTokenSampler,
    slot_params,
)
from pagedserve.sampling_params import SamplingParams  # noqa: E402
from tests.sample.sampling_helpers import add_request, batch_of, make_sampler  # noqa: E402

# Compiled kernels where there is a GPU; the interpreter on CPU tensors elsewhere.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
V = 1000
NEG_INF = float("-inf")

MIXED = [
    SamplingParams(temperature=0.8, top_k=40),
    SamplingParams(top_p=0.9),
    SamplingParams(temperature=1.3, min_p=0.1),
    SamplingParams(temperature=0.0, top_k=3, top_p=0.5),  # greedy: argmax, no cut
    SamplingParams(temperature=0.6, top_k=20, top_p=0.7, seed=3),
    SamplingParams(temperature=1.1, seed=9),  # no truncation
    SamplingParams(top_k=V - 1, top_p=0.999),
    SamplingParams(temperature=0.9, min_p=0.02, top_k=200, top_p=0.95, seed=2**62 + 5),
]


def sampler_for(
    params: list[SamplingParams], engine_seed: int = 0
) -> tuple[Sampler, torch.Tensor, np.ndarray]:
    """A Sampler holding params in reversed, offset slots (so idx_mapping matters)."""
    sampler = make_sampler(len(params) + 3, V, DEVICE, seed=engine_seed)
    slots = [len(params) + 2 - row for row in range(len(params))]
    for slot, p in zip(slots, params, strict=True):
        add_request(sampler, slot, p, [1], [])
    idx_mapping, idx_np = batch_of(slots, DEVICE)
    return sampler, idx_mapping.long(), idx_np


def tied_logits(num_rows: int, seed: int) -> torch.Tensor:
    """bf16 logits in quarter steps (many exact ties, as real bf16 logits have); every third
    token -inf, as logit_bias or min_tokens leave them."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_rows, V, generator=gen) * 12).round() / 4
    logits[:, ::3] = NEG_INF
    return logits.to(torch.bfloat16).to(DEVICE)


def reference_kept(
    sampler: Sampler, logits: torch.Tensor, idx: torch.Tensor, idx_np: np.ndarray
) -> torch.Tensor:
    """bool [num_rows, V]: what the torch reference keeps (greedy rows included: it cuts them
    too, then takes their argmax from the uncut logits)."""
    scaled = truncate(logits.to(torch.float32, copy=True), sampler.states, idx, idx_np)
    return scaled > NEG_INF


def triton_kept(
    sampler: Sampler, logits: torch.Tensor, idx: torch.Tensor, buffer_size: int
) -> torch.Tensor:
    cuts = truncation_cuts(logits, idx, slot_params(sampler.states), buffer_size)
    scaled = logits.float() / sampler.states.temperature[idx].unsqueeze(1)
    return kept_mask(scaled, cuts)


def test_truncation_keeps_the_reference_tokens() -> None:
    """With a 64-token scratch buffer the top-k rows finish their search in it and the wide
    top-p rows on the row itself, so both paths are covered."""
    sampler, idx, idx_np = sampler_for(MIXED)
    logits = tied_logits(len(MIXED), seed=1)
    got = triton_kept(sampler, logits, idx, 64)
    want = reference_kept(sampler, logits, idx, idx_np)
    truncating = [row for row, p in enumerate(MIXED) if not p.greedy]
    assert torch.equal(got[truncating], want[truncating])
    assert bool(got[3].sum() == (logits[3] > NEG_INF).sum()), "a greedy row is not cut"
    finite = (logits > NEG_INF).sum(dim=1)
    assert bool((got.sum(dim=1)[[0, 1, 2, 4]] < finite[[0, 1, 2, 4]]).all())  # they really cut


def test_top_p_splits_tied_logits_as_the_stable_sort_does() -> None:
    """Softmax masses 0.405 (token 100) and 0.149 for each of four tied tokens: top_p 0.6
    keeps the top token and two of the tied ones, the two with the largest indices."""
    row = torch.full((V,), -20.0)
    row[100] = 2.0
    row[[10, 400, 700, 999]] = 1.0
    sampler, idx, idx_np = sampler_for([SamplingParams(top_p=0.6)])
    logits = row.view(1, V).to(DEVICE)
    got = triton_kept(sampler, logits, idx, 64)
    want = reference_kept(sampler, logits, idx, idx_np)
    assert got[0].nonzero().view(-1).tolist() == want[0].nonzero().view(-1).tolist()
    assert got[0].nonzero().view(-1).tolist() == [100, 700, 999]


def test_degenerate_rows() -> None:
    params = [
        SamplingParams(top_k=3, top_p=0.5),  # one finite token
        SamplingParams(top_p=0.2955),  # all logits equal: the last 296 tokens by index stay
        SamplingParams(top_k=10, min_p=0.5),  # fewer finite tokens than top_k
        SamplingParams(temperature=2.0, top_p=0.9),  # -0.0 ties with +0.0 at the top
    ]
    logits = torch.full((4, V), NEG_INF)
    logits[0, 7] = 0.5
    logits[1] = 0.0
    logits[2, [3, 30, 300, 600, 900]] = torch.tensor([1.0, 0.9, 0.2, 1.0, -3.0])
    logits[3, 2:7] = torch.tensor([-0.0, 0.0, -2.0, 0.0, -2.0])
    sampler, idx, idx_np = sampler_for(params)
    logits = logits.to(DEVICE)
    for buffer_size in (4, 4096):
        got = triton_kept(sampler, logits, idx, buffer_size)
        assert torch.equal(got, reference_kept(sampler, logits, idx, idx_np))
        assert got[0].nonzero().view(-1).tolist() == [7]
        assert got[1].nonzero().view(-1).tolist() == list(range(V - 296, V))
        assert got[2].nonzero().view(-1).tolist() == [3, 30, 600]  # 0.2 < 1 + log(0.5)
        # Masses 0.268 for each zero, 0.098 for each -1 (scaled): the second -1 is past 0.9.
        assert got[3].nonzero().view(-1).tolist() == [2, 3, 5, 6]


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fused_pass_samples_the_reference_tokens(num_splits: int) -> None:
    params = [
        SamplingParams(temperature=t, seed=s)
        for t, s in [(1.0, 0), (0.5, 2**63 - 1), (1.7, None), (0.7, 12345), (1.0, None)]
    ] + [SamplingParams(temperature=0.0)]
    sampler, idx, idx_np = sampler_for(params)
    sampler.states.num_output_tokens[idx[1]] = 2**33 + 7  # the counter's high word counts too
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(len(params), V, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
    want = TorchTokenSampler(V, DEVICE).sample(logits, sampler.states, idx, idx_np)
    got = gumbel_sample(logits, idx, slot_params(sampler.states), None, NOISE_HASH, num_splits)
    assert got.dtype == torch.int64
    assert torch.equal(got, want)
    assert int(got[-1]) == int(logits[-1].argmax())


def test_triton_sampler_matches_the_torch_sampler_step_by_step() -> None:
    """End to end through Sampler (logit_bias, penalties and allowed_token_ids give it fp32
    processed logits, the other batches pass raw bf16 logits), advancing the noise counters
    each step."""
    params = MIXED + [
        SamplingParams(temperature=0.7, top_p=0.8, logit_bias={5: 3.0}),
        SamplingParams(top_k=10, presence_penalty=0.5),
        SamplingParams(top_k=5, top_p=0.9, allowed_token_ids=[t for t in range(40) if t % 3]),
        SamplingParams(temperature=1.5, min_p=0.05, allowed_token_ids=[4, 5, 7, 500, 998]),
    ]
    runs = []
    for token_sampler in (TorchTokenSampler(V, DEVICE), TritonTokenSampler(V, DEVICE, 64)):
        sampler, idx, idx_np = sampler_for(params, engine_seed=7)
        sampler.token_sampler = token_sampler
        tokens = []
        for step in range(2):
            rows = idx if step == 0 else idx[:8]  # step 1: no bias/penalty rows, raw logits
            logits = tied_logits(len(rows), seed=10 + step)
            sampled = sampler(logits, rows, idx_np[: len(rows)]).sampled_token_ids
            sampler.update_after_sampling(rows, sampled)
            tokens.append(sampled.tolist())
        runs.append(tokens)
    assert runs[0] == runs[1]


def test_kernel_wrappers_reject_bad_input() -> None:
    sampler, idx, _ = sampler_for([SamplingParams(top_k=2)])
    strided = torch.zeros(1, 2 * V, device=DEVICE)[:, ::2]  # [1, V], stride 2 along V
    with pytest.raises(ValueError, match="logits"):
        truncation_cuts(strided, idx, slot_params(sampler.states))
    with pytest.raises(ValueError, match="buffer_size"):
        truncation_cuts(torch.zeros(1, V, device=DEVICE), idx, slot_params(sampler.states), 100)
    with pytest.raises(ValueError, match="num_splits"):
        gumbel_sample(torch.zeros(1, V, device=DEVICE), idx, slot_params(sampler.states), None,
                      NOISE_HASH, 0)
