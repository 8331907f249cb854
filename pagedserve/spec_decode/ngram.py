"""The ngram proposer (prompt lookup): the tokens that followed an earlier occurrence of the
request's last n tokens are its drafts.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last n token ids are looked
up in the earlier ids (numpy, on the host); the first n that matches wins, and at its earliest
occurrence (the one with the longest continuation, e.g. the prompt's copy of text the output
repeats). No weights, no device work: it costs a few vector compares over the context.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagedserve.spec_decode.proposer import DraftRequest, StatelessProposer


def lookup_drafts(token_ids: np.ndarray, min_n: int, max_n: int, max_drafts: int) -> list[int]:
    """The drafts of one request: ``token_ids`` int64 [num_tokens], its whole history."""
    num_tokens = token_ids.shape[0]
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        # Windows that start at 0 .. num_tokens - n - 1: every occurrence but the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(token_ids[:-1], n)
        hits = np.flatnonzero((windows == token_ids[num_tokens - n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return token_ids[start : start + max_drafts].tolist()
    return []


class NgramProposer(StatelessProposer):
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [
            lookup_drafts(np.asarray(r.token_ids, dtype=np.int64), self.min_n, self.max_n,
                          r.max_drafts)
            for r in requests
        ]
