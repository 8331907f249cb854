"""logit_bias, min_tokens and allowed_token_ids: per-slot changes to a few logits, applied
before penalties.

All are sparse: a slot has a short list of token ids (with values for logit_bias and
min_tokens), kept in a padded per-slot device table and applied with one scatter per batch.
min_tokens adds -inf to the slot's stop tokens (stop_token_ids, and eos unless ignore_eos)
while the slot's output count is below its ``min_tokens`` column; that comparison happens on the
device, so the host never needs the count. allowed_token_ids sets every other logit of the row
to -inf: the allowed logits are gathered, the row filled with -inf, and they are scattered back,
in place (no [num_rows, V] mask).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.math_utils import next_power_of_2
from pagedserve.sample.states import SamplingStates
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.staging import copy_from_host


def min_tokens_stop_ids(params: SamplingParams, eos_token_id: int | None) -> list[int]:
    """The tokens that min_tokens blocks: the ones that would end the request."""
    stop_ids = set(params.stop_token_ids)
    if eos_token_id is not None and not params.ignore_eos:
        stop_ids.add(eos_token_id)
    return sorted(stop_ids)


def add_sparse(logits: torch.Tensor, token_ids: torch.Tensor, values: torch.Tensor) -> None:
    """logits fp32 [num_rows, V] += values fp32 [num_rows, W] at token_ids int64 [num_rows, W].

    Padding pairs are (0, 0.0). Adding (not writing) keeps them harmless even when token 0 also
    appears for real, and -inf values stay -inf whatever else lands on the same token.
    """
    logits.scatter_add_(1, token_ids, values)


class SlotTokenTable:
    """Per slot, a short list of (token id, value) pairs on the device, padded to a common width.

    A row without entries is all padding (token 0, value 0.0), so ``scatter_add_`` of a gathered
    row adds nothing through it. A row is written when a request takes the slot, and only when
    that request or the slot's previous one has entries (most requests have none): then its
    pairs travel in one pinned copy each. The width grows (to the next power of two, on the
    device) when a request brings more pairs; only add_request does that, never a step.
    """

    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.device = device
        self.token_ids = self._table(0, torch.int64)  # int64 [max_num_reqs, width]
        self.values = self._table(0, torch.float32)  # fp32 [max_num_reqs, width]
        self.num_entries = np.zeros(max_num_reqs, dtype=np.int64)  # [max_num_reqs]

    @property
    def width(self) -> int:
        return self.token_ids.shape[1]

    def _table(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(self.max_num_reqs, width, dtype=dtype, device=self.device)

    def _grow(self, num_pairs: int) -> None:
        width = next_power_of_2(num_pairs)
        token_ids, values = self._table(width, torch.int64), self._table(width, torch.float32)
        token_ids[:, : self.width] = self.token_ids
        values[:, : self.width] = self.values
        self.token_ids, self.values = token_ids, values

    def set_row(self, slot: int, token_ids: list[int], values: list[float]) -> None:
        n = len(token_ids)
        if n == 0 and self.num_entries[slot] == 0:
            return  # the row is padding already
        if n > self.width:
            self._grow(n)
        self.token_ids[slot, n:].zero_()
        self.values[slot, n:].zero_()
        if n:
            copy_from_host(self.token_ids[slot, :n], token_ids)
            copy_from_host(self.values[slot, :n], values)
        self.num_entries[slot] = n

    def any_entries(self, idx_mapping_np: np.ndarray) -> bool:
        return bool(np.any(self.num_entries[idx_mapping_np] > 0))


UNRESTRICTED = -1
"""The token ids of a slot without allowed_token_ids, in ``AllowedTokenTable``."""


def keep_only(logits: torch.Tensor, token_ids: torch.Tensor) -> None:
    """logits fp32 [num_rows, V]: -inf except at token_ids int64 [num_rows, W] of its row.

    A row whose ids are all ``UNRESTRICTED`` is left as it is: its ids read as token 0, whose
    own value is gathered and written back. A restricted row pads with a repeat of one of its
    ids, so padding never lets another token through (token 0 in particular).
    """
    restricted = token_ids[:, 0] != UNRESTRICTED  # bool [num_rows]
    token_ids = token_ids.clamp(min=0)  # int64 [num_rows, W]
    kept = logits.gather(1, token_ids)  # fp32 [num_rows, W]
    logits.masked_fill_(restricted.unsqueeze(1), float("-inf"))
    logits.scatter_(1, token_ids, kept)


class AllowedTokenTable:
    """Per slot, the token ids its request may sample (allowed_token_ids), on the device.

    A row is its sorted distinct ids, padded to the table's width with a repeat of its first
    one; a slot without a restriction is all ``UNRESTRICTED``, which is how the device tells the
    rows apart without a flag of their own. Written, in one pinned copy, only when a request
    with a restriction takes the slot or its previous one had one; the width grows (to the next
    power of two) only then, never in a step.
    """

    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.device = device
        self.token_ids = self._table(0)  # int64 [max_num_reqs, width]
        self.num_allowed = np.zeros(max_num_reqs, dtype=np.int64)  # [max_num_reqs]; 0: none

    @property
    def width(self) -> int:
        return self.token_ids.shape[1]

    def _table(self, width: int) -> torch.Tensor:
        return torch.full(
            (self.max_num_reqs, width), UNRESTRICTED, dtype=torch.int64, device=self.device
        )

    def _grow(self, num_ids: int) -> None:
        token_ids = self._table(next_power_of_2(num_ids))
        if self.width:
            token_ids[:, : self.width] = self.token_ids
            token_ids[:, self.width :] = self.token_ids[:, :1]  # each row's padding id
        self.token_ids = token_ids

    def set_row(self, slot: int, token_ids: list[int] | None) -> None:
        ids = sorted(set(token_ids or ()))
        if not ids and self.num_allowed[slot] == 0:
            return  # the row is unrestricted already
        if len(ids) > self.width:
            self._grow(len(ids))
        pad = ids[0] if ids else UNRESTRICTED
        copy_from_host(self.token_ids[slot], ids + [pad] * (self.width - len(ids)))
        self.num_allowed[slot] = len(ids)

    def any_restricted(self, idx_mapping_np: np.ndarray) -> bool:
        return bool(np.any(self.num_allowed[idx_mapping_np] > 0))


class LogitBiasTables:
    """The logit_bias pairs, the min_tokens stop pairs and the allowed token ids of every
    slot."""

    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        self.bias = SlotTokenTable(max_num_reqs, device)
        self.min_tokens_stop = SlotTokenTable(max_num_reqs, device)
        self.allowed = AllowedTokenTable(max_num_reqs, device)

    def add_request(self, slot: int, params: SamplingParams, eos_token_id: int | None) -> None:
        bias = params.logit_bias or {}
        self.bias.set_row(slot, list(bias.keys()), list(bias.values()))
        stop_ids = min_tokens_stop_ids(params, eos_token_id) if params.min_tokens > 0 else []
        self.min_tokens_stop.set_row(slot, stop_ids, [float("-inf")] * len(stop_ids))
        self.allowed.set_row(slot, params.allowed_token_ids)

    def applies_to(self, idx_mapping_np: np.ndarray) -> bool:
        """Whether any row of the batch has a logit_bias, min_tokens stop tokens or allowed
        token ids."""
        return (
            self.bias.any_entries(idx_mapping_np)
            or self.min_tokens_stop.any_entries(idx_mapping_np)
            or self.allowed.any_restricted(idx_mapping_np)
        )

    def apply(
        self,
        logits: torch.Tensor,  # fp32 [num_rows, V], changed in place
        states: SamplingStates,
        idx_mapping: torch.Tensor,  # int64 [num_rows]
        idx_mapping_np: np.ndarray,  # [num_rows]
    ) -> None:
        if self.bias.any_entries(idx_mapping_np):
            add_sparse(
                logits, self.bias.token_ids[idx_mapping], self.bias.values[idx_mapping]
            )
        if self.min_tokens_stop.any_entries(idx_mapping_np):
            # Decided on the device: bool [num_rows], True while the slot is under min_tokens.
            blocked = states.num_output_tokens[idx_mapping] < states.min_tokens[idx_mapping]
            values = self.min_tokens_stop.values[idx_mapping]
            values = torch.where(blocked.unsqueeze(1), values, 0.0)
            add_sparse(logits, self.min_tokens_stop.token_ids[idx_mapping], values)
        if self.allowed.any_restricted(idx_mapping_np):
            keep_only(logits, self.allowed.token_ids[idx_mapping])
