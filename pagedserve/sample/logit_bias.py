"""logit_bias and min_tokens: per-slot additions to a few logits, applied before penalties.

Both are sparse: a slot has a short list of (token id, value) pairs, kept in a padded per-slot
table and applied with one ``scatter_add_`` per batch. min_tokens adds -inf to the slot's stop
tokens (stop_token_ids, and eos unless ignore_eos) while the slot's output count is below
min_tokens; that comparison happens on the device, so the host never needs the count.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.sample.slot_buffer import SlotBuffer, SlotTokenTable
from pagedserve.sampling_params import SamplingParams


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


class LogitBiasState:
    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        self.bias = SlotTokenTable(max_num_reqs, device)
        self.min_tokens_stop = SlotTokenTable(max_num_reqs, device)
        # int64 [max_num_reqs]
        self.min_tokens = SlotBuffer((max_num_reqs,), torch.int64, device, 0)

    def add_request(self, slot: int, params: SamplingParams, eos_token_id: int | None) -> None:
        bias = params.logit_bias or {}
        self.bias.set_row(slot, list(bias.keys()), list(bias.values()))
        stop_ids = min_tokens_stop_ids(params, eos_token_id) if params.min_tokens > 0 else []
        self.min_tokens_stop.set_row(slot, stop_ids, [float("-inf")] * len(stop_ids))
        self.min_tokens[slot] = params.min_tokens

    def remove_request(self, slot: int) -> None:
        self.bias.clear_row(slot)
        self.min_tokens_stop.clear_row(slot)
        self.min_tokens[slot] = 0

    def copy_to_device(self) -> None:
        self.bias.copy_to_device()
        self.min_tokens_stop.copy_to_device()
        self.min_tokens.copy_to_device()

    def applies_to(self, idx_mapping_np: np.ndarray) -> bool:
        """Whether any row of the batch has a logit_bias or min_tokens stop tokens."""
        return self.bias.any_entries(idx_mapping_np) or self.min_tokens_stop.any_entries(
            idx_mapping_np
        )

    def apply(
        self,
        logits: torch.Tensor,  # fp32 [num_rows, V], changed in place
        idx_mapping: torch.Tensor,  # int64 [num_rows]
        idx_mapping_np: np.ndarray,  # [num_rows]
        num_output_tokens: torch.Tensor,  # int64 [max_num_reqs]
    ) -> None:
        if self.bias.any_entries(idx_mapping_np):
            add_sparse(
                logits, self.bias.token_ids.dev[idx_mapping], self.bias.values.dev[idx_mapping]
            )
        if self.min_tokens_stop.any_entries(idx_mapping_np):
            # Decided on the device: bool [num_rows], True while the slot is under min_tokens.
            blocked = num_output_tokens[idx_mapping] < self.min_tokens.dev[idx_mapping]
            values = self.min_tokens_stop.values.dev[idx_mapping]
            values = torch.where(blocked.unsqueeze(1), values, 0.0)
            add_sparse(logits, self.min_tokens_stop.token_ids.dev[idx_mapping], values)
