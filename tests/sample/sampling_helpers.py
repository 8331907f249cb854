"""Helpers for the sampler tests: tiny vocabularies, many slots, chi-square statistics."""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.sample import Sampler, SamplingStates
from pagedserve.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# Upper 0.1% points of the chi-square distribution, by degrees of freedom (any statistics table,
# e.g. NIST/SEMATECH e-Handbook 1.3.6.7.4). A correct sampler fails such a test for one seed in
# a thousand; the seeds below are fixed, so each test's outcome is deterministic.
CHI2_CRITICAL_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def make_sampler(
    num_slots: int, vocab_size: int, device: torch.device, seed: int = 0
) -> Sampler:
    """A Sampler over sampling columns of its own (in the runner they belong to RequestStates)."""
    return Sampler(SamplingStates(num_slots, vocab_size, device, seed))


def add_request(
    sampler: Sampler,
    slot: int,
    params: SamplingParams,
    prompt_token_ids: list[int],
    output_token_ids: list[int],
    eos_token_id: int | None = None,
) -> None:
    """What the runner does for a request that takes ``slot``: its row of sampling columns,
    the sampler's own state of it, and the step's staging copy before the next sampler call."""
    sampler.states.add_request(slot, params, len(output_token_ids))
    sampler.add_request(slot, params, prompt_token_ids, output_token_ids, eos_token_id)
    sampler.states.staging.copy_to_device()


def batch_of(slots: list[int], device: torch.device) -> tuple[torch.Tensor, np.ndarray]:
    """idx_mapping on the device (int32, as the runner builds it) and its host copy."""
    idx_np = np.asarray(slots, dtype=np.int32)
    return torch.from_numpy(idx_np).to(device), idx_np


def draw_counts(
    logits_row: torch.Tensor,
    params: SamplingParams,
    num_slots: int = 64,
    num_steps: int = 64,
    seed: int = 0,
) -> np.ndarray:
    """Histogram of num_slots * num_steps draws from one row of logits, int64 [V].

    Every slot holds an unseeded request with the same params (so each gets its own seed from
    the sampler's engine-seeded generator); each step samples all slots and advances them.
    """
    vocab_size = logits_row.shape[0]
    sampler = make_sampler(num_slots, vocab_size, logits_row.device, seed=seed)
    for slot in range(num_slots):
        add_request(sampler, slot, params, [0], [])
    idx_mapping, idx_np = batch_of(list(range(num_slots)), logits_row.device)
    logits = logits_row.unsqueeze(0).expand(num_slots, -1).contiguous()
    counts = np.zeros(vocab_size, dtype=np.int64)
    for _ in range(num_steps):
        sampled = sampler(logits, idx_mapping, idx_np).sampled_token_ids
        sampler.update_after_sampling(idx_mapping, sampled)
        counts += np.bincount(sampled.cpu().numpy(), minlength=vocab_size)
    return counts


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom over the tokens with probability > 0.

    Tokens whose expected count is below 5 are pooled into one cell (and that cell into the
    smallest other one if it is still below 5), the usual condition for the chi-square
    approximation. Tokens with probability 0 must never be drawn: asserted, not tested.
    """
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {counts}"
    observed = counts[support].astype(np.float64)
    expected = probs[support] / probs[support].sum() * counts.sum()
    order = np.argsort(expected)
    observed, expected = observed[order], expected[order]
    num_small = int((expected < 5).sum())
    if num_small > 0:
        pooled = max(num_small, 2) if len(expected) > 1 else 1
        while pooled < len(expected) and expected[:pooled].sum() < 5:
            pooled += 1
        observed = np.concatenate(([observed[:pooled].sum()], observed[pooled:]))
        expected = np.concatenate(([expected[:pooled].sum()], expected[pooled:]))
    stat = float(((observed - expected) ** 2 / expected).sum())
    return stat, len(expected) - 1


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()
