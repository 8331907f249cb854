"""Token selection: processed logits -> one token id per row.

Two implementations with one interface. ``TorchTokenSampler`` is the reference, built from torch
ops (the CPU path, and the oracle the tests hold the fast path to). ``TritonTokenSampler``
(``triton_token_sampler.py``) does the same on CUDA in two kernels without sorting the
vocabulary. The platform picks one (``Platform.token_sampler``).

Steps, per row: greedy rows (temperature < 1e-5) take the argmax; the others divide by
temperature (fp32), apply min-p, top-k and top-p, then race argmax(x + g) with Gumbel noise g
from the counter-based hash of (seed, output-token index, vocabulary index) (``noise.py``).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from pagedserve.layers import cpu_rows
from pagedserve.sample.noise import gumbel_argmax, vocab_keys
from pagedserve.sample.states import SamplingStates
from pagedserve.sample.topk_topp import apply_min_p, apply_top_k, apply_top_k_top_p


class TokenSampler(Protocol):
    def sample(
        self,
        logits: torch.Tensor,  # [num_rows, V], any float dtype; never modified
        states: SamplingStates,
        idx_mapping: torch.Tensor,  # int64 [num_rows]
        idx_mapping_np: np.ndarray,  # [num_rows]
    ) -> torch.Tensor:  # int64 [num_rows]
        ...


def truncate(
    logits: torch.Tensor,  # fp32 [num_rows, V], owned by the caller: changed in place
    states: SamplingStates,
    idx_mapping: torch.Tensor,  # int64 [num_rows]
    idx_mapping_np: np.ndarray,  # [num_rows]
) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p (dropped tokens become -inf); fp32 [num_rows, V].

    Returns ``logits`` itself, or a new tensor when top-p ran.
    """
    if states.any_temperature(idx_mapping_np):
        logits.div_(states.temperature[idx_mapping].unsqueeze(1))
    if states.any_min_p(idx_mapping_np):
        apply_min_p(logits, states.min_p[idx_mapping])
    max_top_k = states.max_top_k(idx_mapping_np)
    top_k = states.top_k[idx_mapping] if max_top_k > 0 else None
    if states.any_top_p(idx_mapping_np):
        return apply_top_k_top_p(logits, top_k, states.top_p[idx_mapping])
    if top_k is not None:
        apply_top_k(logits, top_k, max_top_k)
    return logits


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[rows, V] -> int64 [rows]: on the CPU the row kernel's argmax (``cpu_rows.argmax_rows``),
    elsewhere (or where it does not apply) argmax taken in fp32. The upcast is exact, so the
    index is the same, and torch's CPU argmax over bf16 is slower than upcast + fp32 argmax
    (docs/cpu.md#greedy-argmax)."""
    if logits.device.type == "cpu":
        ids = cpu_rows.argmax_rows(logits)
        if ids is not None:
            return ids
    return logits.float().argmax(dim=-1)


class TorchTokenSampler:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_keys = vocab_keys(vocab_size, device)  # int64 [V], the noise hash's vocab half

    def sample(
        self,
        logits: torch.Tensor,
        states: SamplingStates,
        idx_mapping: torch.Tensor,
        idx_mapping_np: np.ndarray,
    ) -> torch.Tensor:
        if states.all_greedy(idx_mapping_np):
            return greedy_argmax(logits)
        greedy_ids = greedy_argmax(logits) if states.any_greedy(idx_mapping_np) else None
        scaled = logits.to(torch.float32, copy=True)
        scaled = truncate(scaled, states, idx_mapping, idx_mapping_np)
        counters = states.num_output_tokens[idx_mapping]
        seeds = states.seeds[idx_mapping]
        sampled = gumbel_argmax(scaled, seeds, counters, self.vocab_keys)
        if greedy_ids is not None:
            sampled = torch.where(states.greedy[idx_mapping], greedy_ids, sampled)
        return sampled

