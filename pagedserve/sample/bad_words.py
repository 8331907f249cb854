"""bad_words (vLLM's semantics): the last token of a word's token sequence is blocked whenever
the request's output so far ends with the tokens before it; a one-token word is never sampled.

The prefix is matched against the OUTPUT tokens only, so the device keeps, per slot, a short
ring of the last K output tokens (K: the longest prefix in use), shifted by one token per step
in ``Sampler.update_after_sampling``. The host never sees the tokens of a step: whether a word
matches is decided on the device, and a match adds -inf at its last token with the same
scatter as logit_bias (a word that does not match adds 0 there).

Each slot's words sit in padded device tables, one row of words per slot, prefixes
right-aligned to the ring's width. Like the other per-slot tables, a row is written only when
a request with words takes the slot or the slot's previous request had some, and the tables
grow (to the next power of two) only in ``add_request``, never in a step.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.math_utils import next_power_of_2
from pagedserve.sample.logit_bias import add_sparse
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.staging import copy_from_host

NO_TOKEN = -1
"""A ring position before the request's first output token: equal to no token id."""
ANY_TOKEN = -1
"""A prefix position before the word's first token: matches whatever the ring holds there."""


def words_of(params: SamplingParams) -> list[list[int]]:
    """The token sequences the sampler blocks for a request (the engine fills them from
    ``bad_words``)."""
    return params.bad_words_token_ids or []


class BadWordsTable:
    """Per slot, the bad-word sequences of its request and its last K output tokens (device).

    A word is its prefix (right-aligned in K columns, ``ANY_TOKEN`` before it), the token it
    blocks and a value: -inf for a word, 0.0 for a padding row, whose token 0 then gets +0
    whatever the ring holds (so unused rows never block anything).
    """

    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.device = device
        self.prefixes = self._full((0, 0), ANY_TOKEN, torch.int64)  # int64 [max_num_reqs, W, K]
        self.last_ids = self._full((0,), 0, torch.int64)  # int64 [max_num_reqs, W]
        self.values = self._full((0,), 0.0, torch.float32)  # fp32 [max_num_reqs, W]
        self.recent = self._full((0,), NO_TOKEN, torch.int64)  # int64 [max_num_reqs, K]
        self.num_words = np.zeros(max_num_reqs, dtype=np.int64)  # [max_num_reqs]

    @property
    def width(self) -> int:
        """W: words per slot row."""
        return self.last_ids.shape[1]

    @property
    def prefix_len(self) -> int:
        """K: the longest prefix the tables hold, and the ring's length."""
        return self.recent.shape[1]

    def _full(self, shape: tuple[int, ...], value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((self.max_num_reqs, *shape), value, dtype=dtype, device=self.device)

    def _grow(self, num_words: int, prefix_len: int) -> None:
        """Widen the tables to hold ``num_words`` words with prefixes of ``prefix_len`` tokens:
        new word rows are padding, older prefixes and rings keep their right alignment (a
        request's own prefixes are never longer than the K its ring was seeded with)."""
        w, k = max(self.width, next_power_of_2(num_words)), max(self.prefix_len, next_power_of_2(prefix_len))
        if (w, k) == (self.width, self.prefix_len):
            return
        prefixes = self._full((w, k), ANY_TOKEN, torch.int64)  # int64 [max_num_reqs, w, k]
        prefixes[:, : self.width, k - self.prefix_len :] = self.prefixes
        last_ids = self._full((w,), 0, torch.int64)  # int64 [max_num_reqs, w]
        last_ids[:, : self.width] = self.last_ids
        values = self._full((w,), 0.0, torch.float32)  # fp32 [max_num_reqs, w]
        values[:, : self.width] = self.values
        recent = self._full((k,), NO_TOKEN, torch.int64)  # int64 [max_num_reqs, k]
        recent[:, k - self.prefix_len :] = self.recent
        self.prefixes, self.last_ids, self.values, self.recent = prefixes, last_ids, values, recent

    def add_request(self, slot: int, params: SamplingParams, output_token_ids: list[int]) -> None:
        """Write the slot's words, and seed its ring with the last K of ``output_token_ids``
        (non-empty when a preempted request resumes with its outputs)."""
        words = words_of(params)
        if not words and self.num_words[slot] == 0:
            return  # the row is padding already
        self._grow(len(words), max((len(w) - 1 for w in words), default=0))
        self._write_words(slot, words)
        if words and self.prefix_len:
            tail = output_token_ids[-self.prefix_len :]
            copy_from_host(self.recent[slot], [NO_TOKEN] * (self.prefix_len - len(tail)) + tail)

    def _write_words(self, slot: int, words: list[list[int]]) -> None:
        k, pad = self.prefix_len, self.width - len(words)
        prefixes = np.full((self.width, k), ANY_TOKEN, dtype=np.int64)  # [W, K]
        for i, word in enumerate(words):
            if len(word) > 1:
                prefixes[i, k - len(word) + 1 :] = word[:-1]
        copy_from_host(self.prefixes[slot], prefixes)
        copy_from_host(self.last_ids[slot], [w[-1] for w in words] + [0] * pad)
        copy_from_host(self.values[slot], [float("-inf")] * len(words) + [0.0] * pad)
        self.num_words[slot] = len(words)

    def any_words(self, idx_mapping_np: np.ndarray) -> bool:
        return bool(np.any(self.num_words[idx_mapping_np] > 0))

    def apply(
        self,
        logits: torch.Tensor,  # fp32 [num_rows, V], changed in place
        idx_mapping: torch.Tensor,  # int64 [num_rows]
        idx_mapping_np: np.ndarray,  # [num_rows]
    ) -> None:
        """-inf at the last token of every word whose prefix the row's output ends with (an
        empty prefix always matches); skipped when no row of the batch has words."""
        if not self.any_words(idx_mapping_np):
            return
        prefixes = self.prefixes[idx_mapping]  # int64 [num_rows, W, K]
        recent = self.recent[idx_mapping].unsqueeze(1)  # int64 [num_rows, 1, K]
        matches = ((prefixes == ANY_TOKEN) | (prefixes == recent)).all(dim=2)  # [num_rows, W]
        values = torch.where(matches, self.values[idx_mapping], 0.0)  # fp32 [num_rows, W]
        add_sparse(logits, self.last_ids[idx_mapping], values)

    def update(self, idx_mapping: torch.Tensor, sampled_token_ids: torch.Tensor) -> None:
        """Shift each row's ring left by one and append its new token (all on the device);
        nothing to do while no request has had a word of two tokens or more."""
        if self.prefix_len == 0:
            return
        kept = self.recent[idx_mapping, 1:]  # int64 [num_rows, K - 1]
        shifted = torch.cat([kept, sampled_token_ids.unsqueeze(1)], dim=1)  # [num_rows, K]
        self.recent.index_copy_(0, idx_mapping, shifted)
