"""Chi-square tests: temperature, top-k, top-p and min-p draw from the right distributions.

Each test draws 64 slots x 64 steps = 4096 tokens from a fixed row of 8 logits and compares the
histogram with the distribution computed here independently in float64 numpy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.sampling_params import SamplingParams
from tests.sample.sampling_helpers import CHI2_CRITICAL_0_001, chi_square, draw_counts, softmax

LOGITS = np.array([2.0, 1.4, 1.1, 0.5, 0.0, -0.4, -1.0, -2.2])


def truncate_min_p(probs: np.ndarray, min_p: float) -> np.ndarray:
    return np.where(probs >= min_p * probs.max(), probs, 0.0)


def truncate_top_k(probs: np.ndarray, k: int) -> np.ndarray:
    kth = np.sort(probs)[::-1][k - 1]
    return np.where(probs >= kth, probs, 0.0)


def truncate_top_p(probs: np.ndarray, p: float) -> np.ndarray:
    """Keep a token when the mass of the tokens more likely than it is below p."""
    probs = probs / probs.sum()
    mass_above = np.array([probs[probs > q].sum() for q in probs])
    return np.where(mass_above < p, probs, 0.0)


def normalise(probs: np.ndarray) -> np.ndarray:
    return probs / probs.sum()


CASES = {
    "temperature_1": (SamplingParams(temperature=1.0), softmax(LOGITS)),
    "temperature_0.5": (SamplingParams(temperature=0.5), softmax(LOGITS / 0.5)),
    "temperature_1.7": (SamplingParams(temperature=1.7), softmax(LOGITS / 1.7)),
    "top_k_3": (SamplingParams(top_k=3), normalise(truncate_top_k(softmax(LOGITS), 3))),
    "top_p_0.85": (SamplingParams(top_p=0.85), normalise(truncate_top_p(softmax(LOGITS), 0.85))),
    "min_p_0.1": (SamplingParams(min_p=0.1), normalise(truncate_min_p(softmax(LOGITS), 0.1))),
    # Each truncation removes tokens here: min-p drops 6 and 7, top-k drops 5, and top-p (over
    # the renormalised rest) drops 4; applying top-p before top-k would keep token 4.
    "all_of_them": (
        SamplingParams(temperature=0.8, min_p=0.03, top_k=5, top_p=0.95),
        normalise(
            truncate_top_p(truncate_top_k(truncate_min_p(softmax(LOGITS / 0.8), 0.03), 5), 0.95)
        ),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_distribution_matches(case: str) -> None:
    params, probs = CASES[case]
    counts = draw_counts(torch.tensor(LOGITS, dtype=torch.float32), params)
    stat, dof = chi_square(counts, probs)
    assert stat < CHI2_CRITICAL_0_001[dof], f"{case}: chi2={stat:.2f} (dof {dof}), counts {counts}"


def test_truncations_really_truncate() -> None:
    """The reference distributions differ from the plain softmax, so each case tests its op."""
    support = {case: int((probs > 0).sum()) for case, (_, probs) in CASES.items()}
    assert support == {
        "temperature_1": 8,
        "temperature_0.5": 8,
        "temperature_1.7": 8,
        "top_k_3": 3,
        "top_p_0.85": 4,
        "min_p_0.1": 5,
        "all_of_them": 4,
    }


def test_chi_square_rejects_a_wrong_distribution() -> None:
    """Power check: draws at temperature 0.5 are far from the temperature-1 distribution."""
    counts = draw_counts(torch.tensor(LOGITS, dtype=torch.float32), SamplingParams(temperature=0.5))
    stat, dof = chi_square(counts, softmax(LOGITS))
    assert stat > 10 * CHI2_CRITICAL_0_001[dof]
