"""Repetition, frequency and presence penalties (vLLM's semantics).

- repetition_penalty r: for every token seen in the prompt or the output so far, a positive logit
  is divided by r and a negative one multiplied by r.
- frequency_penalty f and presence_penalty p, over output tokens only:
  logit -= f * count + p * (count > 0).

The penalties themselves are columns of ``SamplingStates``; the token statistics they read live
here, in per-slot device tensors allocated the first time a request uses a penalty (they are
[max_num_reqs, V], large for big vocabularies).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.sample.states import SamplingStates, uses_penalties
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.staging import host_to_device


def apply_penalties(
    logits: torch.Tensor,  # fp32 [num_rows, V], changed in place
    repetition_penalty: torch.Tensor,  # fp32 [num_rows]
    frequency_penalty: torch.Tensor,  # fp32 [num_rows]
    presence_penalty: torch.Tensor,  # fp32 [num_rows]
    prompt_mask: torch.Tensor,  # bool [num_rows, V]: token occurs in the prompt
    output_counts: torch.Tensor,  # int32 [num_rows, V]: occurrences in the output so far
) -> None:
    in_output = output_counts > 0
    scale = torch.where(prompt_mask | in_output, repetition_penalty.unsqueeze(1), 1.0)
    logits.copy_(torch.where(logits > 0, logits / scale, logits * scale))
    logits.sub_(frequency_penalty.unsqueeze(1) * output_counts)
    logits.sub_(presence_penalty.unsqueeze(1) * in_output)


class PenaltyHistories:
    """Per slot, the tokens of the prompt and the counts of the outputs so far (device)."""

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        # Allocated on first use. Rows of slots without penalties hold stale values: they are
        # rebuilt in add_request whenever a request that uses penalties takes the slot.
        self.prompt_mask: torch.Tensor | None = None  # bool [max_num_reqs, V]
        self.output_counts: torch.Tensor | None = None  # int32 [max_num_reqs, V]

    def _allocate(self) -> None:
        shape = (self.max_num_reqs, self.vocab_size)
        self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)

    def add_request(
        self,
        slot: int,
        params: SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
    ) -> None:
        if not uses_penalties(params):
            return
        if self.output_counts is None:
            self._allocate()
        assert self.prompt_mask is not None and self.output_counts is not None
        prompt = host_to_device(prompt_token_ids, torch.int64, self.device)
        output = host_to_device(output_token_ids, torch.int64, self.device)
        # index_fill_/index_add_, not bincount: CUDA's bincount reads the max back to the host.
        self.prompt_mask[slot].zero_()
        self.prompt_mask[slot].index_fill_(0, prompt, True)
        self.output_counts[slot].zero_()
        self.output_counts[slot].index_add_(0, output, torch.ones_like(output, dtype=torch.int32))

    def apply(
        self,
        logits: torch.Tensor,  # fp32 [num_rows, V], changed in place
        states: SamplingStates,
        idx_mapping: torch.Tensor,  # int64 [num_rows]
        idx_mapping_np: np.ndarray,  # [num_rows]
    ) -> None:
        """Penalise the batch's logits; skipped when no row uses penalties."""
        if not states.any_penalties(idx_mapping_np):
            return
        assert self.prompt_mask is not None and self.output_counts is not None
        apply_penalties(
            logits,
            states.repetition_penalty[idx_mapping],
            states.frequency_penalty[idx_mapping],
            states.presence_penalty[idx_mapping],
            self.prompt_mask[idx_mapping],
            self.output_counts[idx_mapping],
        )

    def count_sampled(self, idx_mapping: torch.Tensor, sampled_token_ids: torch.Tensor) -> None:
        """Add one occurrence of each row's new token to its slot's counts (all on the device)."""
        if self.output_counts is None:
            return
        flat_index = idx_mapping * self.vocab_size + sampled_token_ids  # int64 [num_rows]
        ones = torch.ones_like(flat_index, dtype=torch.int32)
        self.output_counts.view(-1).index_add_(0, flat_index, ones)
