"""Request: one sequence's life in the scheduler (token history, progress, status).

It lives in core/ because the scheduler owns its lifecycle; engine/ builds it from user input.
"""

from __future__ import annotations

import enum
import time
from typing import Protocol

from pagedserve.lora.request import LoRARequest
from pagedserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_GRAMMAR = 1
    """Structured output: held out of the waiting queue until its grammar is compiled."""
    RUNNING = 2
    PREEMPTED = 3
    # Everything from here on is finished.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class GrammarState(Protocol):
    """A constrained request's grammar as the scheduler sees it
    (``structured_output.request.StructuredOutputRequest``)."""

    def is_ready(self) -> bool: ...

    def error(self) -> str | None: ...

    def accept_token(self, token_id: int) -> bool: ...

    def is_terminated(self) -> bool: ...


class Request:
    """A sequence: prompt, generated tokens, and how many of them have KV in the cache.

    Invariant: ``num_computed_tokens <= num_tokens``; the tokens in
    ``all_token_ids[num_computed_tokens:]`` are the ones still to be run through the model.
    Under async scheduling the bound is ``num_tokens + num_output_placeholders``: a step may
    be scheduled before the token sampled by the step in flight is known.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        max_tokens: int,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.max_tokens = max_tokens
        """Resolved output-length cap (the input processor clips it to the context)."""
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        """Lower value = served first under the ``priority`` policy (vLLM's convention)."""
        self.cache_salt = cache_salt
        """Mixed into the first block's hash: prefix-cache hits only between equal salts."""
        self.lora_request = lora_request
        """The adapter it runs with; its id is mixed into the first block's hash too."""

        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        """Prompt tokens found in the prefix cache at first scheduling (-1: not yet scheduled)."""
        self.num_preemptions = 0
        self.num_output_placeholders = 0
        """Async scheduling: tokens being sampled by scheduled steps whose output has not been
        appended yet (always 0 with synchronous scheduling)."""
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_hashes: list[int] = []
        """Hash of every full block of ``all_token_ids`` (filled by the KV-cache manager)."""
        self.first_scheduled_time: float | None = None
        self.structured_output: GrammarState | None = None
        """Set by the engine core for a request with ``structured_outputs``."""
        self.draft_acceptance = 1.0
        """Speculative decoding: moving average of its drafts' acceptance rate
        (``spec_decode/gate.py``)."""
        self.draft_pause = 0
        """Steps left without drafts after the acceptance rate fell too low."""
        self.draft_hot = True
        """Speculative decoding: its last n-gram lookup found drafts (a new request has not
        looked yet), so the engine core plans its next step synchronously."""
        self.num_prompt_logprob_rows = 0
        """Prompt-logprob rows received since the request was last admitted; they come in
        position order from position 1 (such a request never reads the prefix cache)."""
        self.num_prompt_logprob_rows_sent = 0
        """Rows passed on: a prompt recomputed after a preemption sends only the rows after."""

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def reads_prefix_cache(self) -> bool:
        """Prompt logprobs come from the prompt's own forward pass, which a prefix-cache hit
        skips: a request that asks for them computes its whole prompt (as vLLM's does)."""
        return self.sampling_params.prompt_logprobs is None

    def take_prompt_logprob_rows(self, num_rows: int) -> int:
        """Count the next ``num_rows`` prompt-logprob rows as received; returns how many of
        them, from the first, were sent before a preemption (the caller drops those)."""
        first = self.num_prompt_logprob_rows
        self.num_prompt_logprob_rows += num_rows
        already_sent = min(max(self.num_prompt_logprob_rows_sent - first, 0), num_rows)
        self.num_prompt_logprob_rows_sent = max(self.num_prompt_logprob_rows_sent,
                                                self.num_prompt_logprob_rows)
        return already_sent

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
