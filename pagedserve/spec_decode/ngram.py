"""The ngram proposer (prompt lookup): the tokens that followed an earlier occurrence of the
request's last n tokens are its drafts.

The longest n in ``prompt_lookup_min..prompt_lookup_max`` whose last-n tokens occurred before
wins, at its earliest occurrence (the one with the longest continuation, e.g. the prompt's
copy of text the output repeats). No weights, no device work: one vector compare finds the
earlier positions of the last token, and only those are extended backwards. Each request's ids
are kept in a numpy array that grows with the appended tokens, so a step converts only those.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from pagedserve.spec_decode.proposer import DraftRequest


def lookup_drafts(token_ids: np.ndarray, min_n: int, max_n: int, max_drafts: int) -> list[int]:
    """The drafts of one request: ``token_ids`` int64 [num_tokens], its whole history."""
    num_tokens = token_ids.shape[0]
    max_n = min(max_n, num_tokens - 1)
    if max_n < min_n:
        return []
    ends = np.flatnonzero(token_ids[: num_tokens - 1] == token_ids[-1])  # earlier last tokens
    for k in range(1, max_n):  # keep the ends whose match reaches k + 1 tokens, if any does
        back = ends - k
        longer = ends[(back >= 0) & (token_ids[np.maximum(back, 0)] == token_ids[-1 - k])]
        if longer.size == 0:
            max_n = k
            break
        ends = longer
    if max_n < min_n or ends.size == 0:
        return []
    start = int(ends[0]) + 1  # the earliest occurrence of the longest match
    return token_ids[start : start + max_drafts].tolist()


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.histories: dict[str, tuple[np.ndarray, int]] = {}
        """req_id -> (int64 [capacity] token ids, how many are filled)."""

    def finish(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.histories.pop(req_id, None)

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [lookup_drafts(self._history(r), self.min_n, self.max_n, r.max_drafts)
                for r in requests]

    def _history(self, request: DraftRequest) -> np.ndarray:
        """The request's ids as int64 [num_tokens]: its array, grown by the new ids."""
        num_tokens = len(request.token_ids)
        array, filled = self.histories.get(request.req_id, (np.empty(0, np.int64), 0))
        if num_tokens > array.shape[0]:
            grown = np.empty(max(2 * array.shape[0], num_tokens + 64), dtype=np.int64)
            grown[:filled] = array[:filled]
            array = grown
        array[filled:num_tokens] = request.token_ids[filled:num_tokens]
        self.histories[request.req_id] = (array, num_tokens)
        return array[:num_tokens]
