"""The sampler: the per-step pipeline that turns logits into token ids.

It reads the sampling parameters from ``SamplingStates`` (the sampling columns of the request
slots, brought to the device by the step's staging copy) and keeps only what is its own: the
token histories of the penalties, the logit_bias / min_tokens / allowed_token_ids tables and
the bad_words tables with their rings of recent output tokens, device tensors keyed by the same
slots.

Per step (rows gathered through idx_mapping, batch row -> slot):
  1. logits upcast to fp32 (the model's logits stay untouched, for raw logprobs)
  2. logit_bias, then min_tokens (-inf on stop tokens while the slot is under min_tokens), then
     allowed_token_ids (-inf on every other token), then bad_words (-inf on the last token of
     each word whose other tokens the output ends with, decided on the device), so every later
     step, greedy included, chooses among the allowed tokens only
  3. repetition / frequency / presence penalties
  4. greedy rows (temperature < 1e-5): argmax of these processed logits
  5. other rows: divide by temperature (fp32), min-p, top-k, top-p, then the Gumbel-max race
     argmax(logits + g) with g from a counter-based hash of (seed, output index, vocab index)
     (token_sampler.py: torch ops on the CPU, Triton kernels on CUDA, same tokens)
  6. logprobs, if any row asks: raw log_softmax of the model's logits (see logprob.py), so
     unaffected by steps 2-5 (vLLM's default, "raw_logprobs")

Steps 2-3 run only when some row of the batch needs them; otherwise step 5 reads the model's
logits as they are (the token samplers never modify their input).

Nothing here makes the device wait for the host: no ``.item()``, no ``torch.multinomial``, no
branch on a device value. The only branches are on host-side facts about the batch, read from
the host columns of the per-slot parameters with idx_mapping_np.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.platform import platform_for
from pagedserve.sample.bad_words import BadWordsTable, words_of
from pagedserve.sample.logit_bias import LogitBiasTables, min_tokens_stop_ids
from pagedserve.sample.logprob import LogprobsTensors, compute_topk_logprobs
from pagedserve.sample.penalties import PenaltyHistories
from pagedserve.sample.states import NO_LOGPROBS, SamplingStates, uses_penalties
from pagedserve.sampling_params import SamplingParams


def _check_token_ids(field: str, token_ids: list[int], vocab_size: int) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{field}: token id(s) {bad[:5]} out of vocabulary (size {vocab_size})")


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [num_rows]
    logprobs: LogprobsTensors | None  # None when no row of the batch asked for logprobs


class Sampler:
    def __init__(self, states: SamplingStates) -> None:
        """``states``: the sampling columns it reads (their writes are the caller's, with the
        staging copy that brings them to the device before a call)."""
        self.states = states
        self.max_num_reqs = states.max_num_reqs
        self.vocab_size = states.vocab_size
        self.device = states.device
        self.penalties = PenaltyHistories(self.max_num_reqs, self.vocab_size, self.device)
        self.logit_bias = LogitBiasTables(self.max_num_reqs, self.device)
        self.bad_words = BadWordsTable(self.max_num_reqs, self.device)
        # The platform's: torch ops on the CPU, Triton kernels on CUDA; tests may swap it.
        self.token_sampler = platform_for(self.device).token_sampler(self.vocab_size)

    def add_request(
        self,
        slot: int,
        params: SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        eos_token_id: int | None = None,
    ) -> None:
        """Build the sampler's own state of a request that takes ``slot`` (its parameters are
        in ``states`` already): penalty histories, logit_bias, min_tokens stop tokens, allowed
        token ids and bad words.

        output_token_ids is non-empty when a preempted request resumes: its penalty counts
        and its bad words' recent tokens continue where they stopped (``states`` continues its
        output count, hence min_tokens progress and the seeded noise stream).
        """
        if not 0 <= slot < self.max_num_reqs:
            raise ValueError(f"slot: {slot} not in [0, {self.max_num_reqs})")
        _check_token_ids("logit_bias", list(params.logit_bias or {}), self.vocab_size)
        _check_token_ids("allowed_token_ids", params.allowed_token_ids or [], self.vocab_size)
        _check_token_ids(
            "bad_words_token_ids", [t for w in words_of(params) for t in w], self.vocab_size
        )
        _check_token_ids(
            "stop_token_ids", min_tokens_stop_ids(params, eos_token_id), self.vocab_size
        )
        if uses_penalties(params):  # only penalties index device tensors with these ids
            _check_token_ids("prompt_token_ids", prompt_token_ids, self.vocab_size)
            _check_token_ids("output_token_ids", output_token_ids, self.vocab_size)
        self.penalties.add_request(slot, params, prompt_token_ids, output_token_ids)
        self.logit_bias.add_request(slot, params, eos_token_id)
        self.bad_words.add_request(slot, params, output_token_ids)

    def __call__(
        self, logits: torch.Tensor, idx_mapping: torch.Tensor, idx_mapping_np: np.ndarray
    ) -> SamplerOutput:
        """Sample one token per row of logits [num_rows, V] (model dtype)."""
        sampled = self.sample(logits, idx_mapping, idx_mapping_np)
        num_logprobs = self.states.max_num_logprobs(idx_mapping_np)
        logprobs = None
        if num_logprobs != NO_LOGPROBS:
            logprobs = compute_topk_logprobs(logits, num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def sample(
        self, logits: torch.Tensor, idx_mapping: torch.Tensor, idx_mapping_np: np.ndarray
    ) -> torch.Tensor:
        """int64 [num_rows]: the tokens alone (steps 1-5), each row at its slot's output
        index (``states.num_output_tokens``)."""
        self._check_batch(logits, idx_mapping, idx_mapping_np)
        idx_mapping = idx_mapping.to(torch.int64)
        processed = logits
        if self._processes(idx_mapping_np):
            processed = self._process(logits, idx_mapping, idx_mapping_np)
        return self.token_sampler.sample(processed, self.states, idx_mapping, idx_mapping_np)

    def _processes(self, idx_mapping_np: np.ndarray) -> bool:
        """Whether steps 2-3 change any row of the batch (a host-side fact)."""
        return (
            self.logit_bias.applies_to(idx_mapping_np)
            or self.bad_words.any_words(idx_mapping_np)
            or self.states.any_penalties(idx_mapping_np)
        )

    def process_logits(
        self, logits: torch.Tensor, idx_mapping: torch.Tensor, idx_mapping_np: np.ndarray
    ) -> torch.Tensor:
        """fp32 [num_rows, V]: the logits after logit_bias, min_tokens, allowed_token_ids,
        bad_words and penalties.

        A new tensor; ``logits`` is not modified. Temperature and truncation come later.
        """
        self._check_batch(logits, idx_mapping, idx_mapping_np)
        return self._process(logits, idx_mapping.to(torch.int64), idx_mapping_np)

    def _process(
        self, logits: torch.Tensor, idx_mapping: torch.Tensor, idx_mapping_np: np.ndarray
    ) -> torch.Tensor:
        processed = logits.to(torch.float32, copy=True)  # [num_rows, V]
        self.logit_bias.apply(processed, self.states, idx_mapping, idx_mapping_np)
        self.bad_words.apply(processed, idx_mapping, idx_mapping_np)
        self.penalties.apply(processed, self.states, idx_mapping, idx_mapping_np)
        return processed

    def update_after_sampling(
        self, idx_mapping: torch.Tensor, sampled_token_ids: torch.Tensor
    ) -> None:
        """Record the tokens kept this step, on the device: penalty counts, the bad words'
        recent output tokens and output counters.

        Call it with the rows whose tokens are kept (not rows of a partial prefill, whose token
        is thrown away); each slot at most once per call.
        """
        idx_mapping = idx_mapping.to(torch.int64)
        sampled_token_ids = sampled_token_ids.view(-1).to(torch.int64)
        self.states.num_output_tokens.index_add_(0, idx_mapping, torch.ones_like(idx_mapping))
        self.penalties.count_sampled(idx_mapping, sampled_token_ids)
        self.bad_words.update(idx_mapping, sampled_token_ids)

    def _check_batch(
        self, logits: torch.Tensor, idx_mapping: torch.Tensor, idx_mapping_np: np.ndarray
    ) -> None:
        """Shape checks only (host-side metadata, never device values)."""
        if logits.dim() != 2 or logits.shape[1] != self.vocab_size:
            raise ValueError(
                f"logits: expected [num_rows, {self.vocab_size}], got {list(logits.shape)}"
            )
        if idx_mapping.shape != (logits.shape[0],) or idx_mapping_np.shape != (logits.shape[0],):
            raise ValueError(
                f"idx_mapping: expected [{logits.shape[0]}] on device and host, got "
                f"{list(idx_mapping.shape)} and {list(idx_mapping_np.shape)}"
            )
