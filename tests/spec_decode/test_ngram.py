"""The ngram proposer: the longest suffix that occurred before wins, at its earliest
occurrence, and drafts never exceed what the request may take."""

from __future__ import annotations

import numpy as np

from pagedserve.spec_decode.ngram import NgramProposer, lookup_drafts
from pagedserve.spec_decode.proposer import DraftRequest


def _ids(*tokens: int) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64)


def test_the_longest_matching_suffix_wins_at_its_earliest_occurrence():
    # Suffix (2, 3) occurs at 1 and 6; (9, 2, 3) only at 5: the longer one decides.
    tokens = _ids(1, 2, 3, 4, 9, 2, 3, 7, 8, 9, 2, 3)
    assert lookup_drafts(tokens, 1, 3, 3) == [7, 8, 9]
    # Limited to suffixes of 2: the earliest (2, 3) is at 1, its continuation 4, 9, 2.
    assert lookup_drafts(tokens, 1, 2, 3) == [4, 9, 2]


def test_no_match_no_drafts_and_short_continuations():
    assert lookup_drafts(_ids(1, 2, 3, 4), 1, 3, 4) == []
    assert lookup_drafts(_ids(5), 1, 3, 4) == []
    # The only earlier occurrence of 6 is right before the end: one token follows it.
    assert lookup_drafts(_ids(1, 6, 6), 1, 2, 4) == [6]
    # Below prompt_lookup_min nothing is looked up.
    assert lookup_drafts(_ids(1, 2, 5, 2), 2, 3, 4) == []


def test_proposer_respects_each_requests_limit():
    proposer = NgramProposer(1, 4)
    pattern = [4, 5, 6, 7]
    drafts = proposer.propose([DraftRequest("a", pattern * 3, 2),
                               DraftRequest("b", pattern * 3, 5),
                               DraftRequest("c", [1, 2, 3], 3)])
    assert drafts == [[4, 5], [4, 5, 6, 7, 4], []]


def _brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """For n from max_n down: the earliest earlier occurrence of the last n tokens."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + k]
    return []


def test_lookup_equals_the_brute_force_search():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 30))).tolist()
        min_n = int(rng.integers(1, 3))
        max_n = min_n + int(rng.integers(0, 4))
        assert lookup_drafts(_ids(*tokens), min_n, max_n, 3) == _brute_force(
            tokens, min_n, max_n, 3), tokens


def test_histories_grow_with_the_request_and_go_with_it():
    proposer = NgramProposer(1, 3)
    tokens = [1, 2, 3, 1, 2]
    assert proposer.propose([DraftRequest("a", tokens, 2)]) == [[3, 1]]
    tokens += [7, 1]
    assert proposer.propose([DraftRequest("a", tokens, 2)]) == [[2, 3]]
    proposer.finish(["a"])
    assert proposer.histories == {}
