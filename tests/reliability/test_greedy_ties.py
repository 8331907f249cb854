"""Greedy sampling on exact ties (frequent in bf16 logits) takes the lowest token id, in the
torch sampler and in the fused Triton pass, whatever the rest of the batch: a tie never
depends on the batch. (bf16 greedy outputs can still depend on the batch: its shape changes
the matmuls' rounding, so the logits themselves differ in their last bits.)"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from pagedserve.kernels.sampling_gumbel import gumbel_sample  # noqa: E402
from pagedserve.sample import Sampler  # noqa: E402
from pagedserve.sample.token_sampler import TorchTokenSampler  # noqa: E402
from pagedserve.sample.triton_token_sampler import NOISE_HASH, slot_params  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402
from tests.sample.sampling_helpers import add_request, make_sampler  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
V = 1000
TIED = [7, 300, 999]
"""The tokens sharing the top logit in every greedy row."""


def _batch(num_sampled: int) -> tuple[Sampler, torch.Tensor, np.ndarray, torch.Tensor]:
    params = [SamplingParams(temperature=0.0)] * 2 + [
        SamplingParams(temperature=1.0, seed=s) for s in range(num_sampled)
    ]
    sampler = make_sampler(len(params), V, DEVICE, seed=0)
    for slot, p in enumerate(params):
        add_request(sampler, slot, p, [1], [])
    idx_np = np.arange(len(params), dtype=np.int32)
    logits = torch.zeros(len(params), V)
    logits[:, TIED] = 5.0
    return sampler, torch.from_numpy(idx_np).to(DEVICE).long(), idx_np, logits


@pytest.mark.parametrize("num_sampled", [0, 3])
def test_torch_sampler_breaks_ties_to_the_lowest_id(num_sampled: int) -> None:
    sampler, idx, idx_np, logits = _batch(num_sampled)
    for dtype in (torch.float32, torch.bfloat16):
        got = TorchTokenSampler(V, DEVICE).sample(
            logits.to(dtype).to(DEVICE), sampler.states, idx, idx_np
        )
        assert got[:2].tolist() == [TIED[0]] * 2


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fused_pass_breaks_ties_to_the_lowest_id(num_splits: int) -> None:
    sampler, idx, _, logits = _batch(3)
    got = gumbel_sample(logits.to(torch.bfloat16).to(DEVICE), idx, slot_params(sampler.states),
                        None, NOISE_HASH, num_splits)
    assert got[:2].tolist() == [TIED[0]] * 2
