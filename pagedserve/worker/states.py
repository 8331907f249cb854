"""Request slots: every running request owns one row of each per-request buffer for its life.

A step never moves rows; it reads them through ``idx_mapping`` (batch row -> slot). Slots are
handed out from the top (the first request gets ``max_num_reqs - 1``) and a freed slot is the
next one handed out again.

Host numpy arrays hold what the host must know without asking the device (counts, lengths).
Those the device reads too live in a ``StagingBuffer`` (shared with the runner's other per-step
arrays): its one copy per step updates their device twins. The sampling parameters are columns
of the same slots (``sampling``, a ``SamplingStates`` in the same staging buffer), read by the
sampler. Token ids of a prompt live on the device only (``all_token_ids``): the input kernels
read them from there.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.sample.states import SamplingStates
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.staging import StagedArray, StagingBuffer, copy_from_host


class RequestStates:
    @staticmethod
    def staged_arrays(max_num_reqs: int) -> list[StagedArray]:
        """The arrays RequestStates keeps in a staging buffer, its sampling columns included."""
        return [
            StagedArray("num_computed_tokens", torch.int32, max_num_reqs),
            StagedArray("prefill_len", torch.int32, max_num_reqs),
            *SamplingStates.staged_arrays(max_num_reqs),
        ]

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        vocab_size: int,
        device: torch.device,
        seed: int = 0,
        staging: StagingBuffer | None = None,
    ) -> None:
        """``staging`` must hold ``staged_arrays(max_num_reqs)``; None: a buffer of its own.
        ``seed``: the engine seed, from which requests without a seed get theirs."""
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = device
        if staging is None:
            staging = StagingBuffer(self.staged_arrays(max_num_reqs), device)
        self.staging = staging

        self.req_id_to_index: dict[str, int] = {}
        self.index_to_req_id: dict[int, str] = {}
        # Stack of free slots: pop() takes the highest, a freed slot is pushed back on top.
        self.free_slots: list[int] = list(range(max_num_reqs))

        # Tokens whose KV is in the cache (set by the scheduler each step).
        self.num_computed_tokens_np = staging.host["num_computed_tokens"]  # int32 [max_num_reqs]
        self.num_computed_tokens = staging.device_views[
            "num_computed_tokens"
        ]  # int32 [max_num_reqs], device twin
        # Tokens to prefill from all_token_ids (prompt, plus outputs of a preempted request).
        self.prefill_len_np = staging.host["prefill_len"]  # int32 [max_num_reqs]
        self.prefill_len = staging.device_views["prefill_len"]  # int32 [max_num_reqs], twin
        self.num_prompt_tokens_np = np.zeros(max_num_reqs, dtype=np.int32)  # [max_num_reqs]
        # Output tokens a request brings back in its prefill (resumed after preemption; else 0).
        self.num_resumed_output_tokens_np = np.zeros(
            max_num_reqs, dtype=np.int32
        )  # [max_num_reqs]
        # Row s, entries [0, prefill_len[s]): the slot's prefill tokens. Later entries unused:
        # generated tokens reach the next step through last_sampled_tokens.
        self.all_token_ids = torch.zeros(
            max_num_reqs, max_model_len, dtype=torch.int32, device=device
        )  # int32 [max_num_reqs, max_model_len]
        # The token sampled last for each slot, written on the device by sample_tokens and read
        # by the next step's input preparation; the host never needs it to build a step.
        self.last_sampled_tokens = torch.zeros(
            max_num_reqs, dtype=torch.int64, device=device
        )  # int64 [max_num_reqs]
        self.sampling_params: list[SamplingParams | None] = [None] * max_num_reqs
        self.sampling = SamplingStates(max_num_reqs, vocab_size, device, seed, staging)
        # Per slot, from its SamplingParams, for a vectorised question about a batch.
        self.wants_prompt_logprobs_np = np.zeros(max_num_reqs, dtype=bool)  # [max_num_reqs]
        self.num_prompt_logprobs_reqs = 0
        """Slots whose request asks for prompt logprobs (0: no step needs to look)."""

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(
        self,
        req_id: str,
        prefill_token_ids: list[int],
        num_prompt_tokens: int,
        num_computed_tokens: int,
        sampling_params: SamplingParams,
    ) -> int:
        """Give ``req_id`` a slot and store its prefill tokens; returns the slot."""
        if req_id in self.req_id_to_index:
            raise ValueError(f"req_id: request {req_id!r} already owns slot "
                             f"{self.req_id_to_index[req_id]}")
        if not self.free_slots:
            raise ValueError(f"max_num_seqs: all {self.max_num_reqs} request slots are in use")
        prefill_len = len(prefill_token_ids)
        if not 0 < prefill_len <= self.max_model_len:
            raise ValueError(f"prefill_token_ids: request {req_id!r} has {prefill_len} tokens, "
                             f"must be 1..max_model_len ({self.max_model_len})")
        if not 0 < num_prompt_tokens <= prefill_len:
            raise ValueError(f"num_prompt_tokens: {num_prompt_tokens} for request {req_id!r} "
                             f"is not in 1..{prefill_len}")
        slot = self.free_slots.pop()
        self.req_id_to_index[req_id] = slot
        self.index_to_req_id[slot] = req_id
        self.prefill_len_np[slot] = prefill_len
        self.num_prompt_tokens_np[slot] = num_prompt_tokens
        self.num_resumed_output_tokens_np[slot] = prefill_len - num_prompt_tokens
        self.num_computed_tokens_np[slot] = num_computed_tokens
        self.sampling_params[slot] = sampling_params
        self.sampling.add_request(slot, sampling_params, prefill_len - num_prompt_tokens)
        wants_prompt_logprobs = sampling_params.prompt_logprobs is not None
        self.wants_prompt_logprobs_np[slot] = wants_prompt_logprobs
        self.num_prompt_logprobs_reqs += wants_prompt_logprobs
        copy_from_host(self.all_token_ids[slot, :prefill_len], prefill_token_ids)
        return slot

    def extend_prefill(self, req_id: str, token_ids: list[int]) -> None:
        """Place ``token_ids`` from the running request's computed tokens on, as tokens to
        prefill (its ``num_computed_tokens`` is this step's already)."""
        slot = self.req_id_to_index[req_id]
        start = int(self.num_computed_tokens_np[slot])
        end = start + len(token_ids)
        if not start < end <= self.max_model_len:
            raise ValueError(f"new_token_ids: request {req_id!r} would reach {end} tokens, "
                             f"must be {start + 1}..max_model_len ({self.max_model_len})")
        copy_from_host(self.all_token_ids[slot, start:end], token_ids)
        self.prefill_len_np[slot] = end

    def remove_request(self, req_id: str) -> int | None:
        """Free the slot of ``req_id``; returns it, or None when the request has no slot."""
        slot = self.req_id_to_index.pop(req_id, None)
        if slot is None:
            return None
        del self.index_to_req_id[slot]
        self.sampling_params[slot] = None
        self.sampling.remove_request(slot)
        self.num_prompt_logprobs_reqs -= bool(self.wants_prompt_logprobs_np[slot])
        self.wants_prompt_logprobs_np[slot] = False
        self.free_slots.append(slot)
        return slot

    def set_num_computed_tokens(self, req_id: str, num_computed_tokens: int) -> int:
        """Mirror the scheduler's count for a running request; returns its slot."""
        return int(self.set_num_computed_tokens_batch([req_id], [num_computed_tokens])[0])

    def set_num_computed_tokens_batch(
        self, req_ids: list[str], num_computed_tokens: list[int]
    ) -> np.ndarray:
        """``set_num_computed_tokens`` for many running requests at once (one numpy write);
        returns their slots, int64 [len(req_ids)]."""
        try:
            slots = np.fromiter(map(self.req_id_to_index.__getitem__, req_ids), dtype=np.int64,
                                count=len(req_ids))
        except KeyError as e:
            raise ValueError(f"scheduled_cached_reqs: request {e.args[0]!r} has no slot") from None
        self.num_computed_tokens_np[slots] = num_computed_tokens
        return slots

    def apply_staged_writes(self) -> None:
        """Copy the host counts to their device twins: the staging buffer's one copy (the
        runner makes that copy itself, once per step, for every array of its buffer)."""
        self.staging.copy_to_device()
