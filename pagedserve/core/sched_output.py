"""What crosses the scheduler/runner boundary each step: the ``SchedulerOutput``
(docs/architecture.md#life-of-a-request).

The runner mirrors the scheduler's decisions in persistent request slots, so the plan carries
only what changed: new requests in full, running requests as deltas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.lora.request import LoRARequest
from pagedserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.structured_output.bitmask import GrammarBitmask

BlockIds = tuple[list[int], ...]
"""Block ids per KV-cache group (one group for the Llama family)."""


@dataclass
class NewRequestData:
    """A request the runner has no slot for: first scheduling, or resumed after preemption.

    ``prefill_token_ids`` is the whole token history known to the scheduler (prompt, plus the
    tokens generated before a preemption); all of it beyond ``num_computed_tokens`` is prefilled.
    """

    req_id: str
    prefill_token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: BlockIds
    num_computed_tokens: int
    """Tokens whose KV is already cached (prefix-cache hits), a multiple of block_size."""
    num_output_tokens: int = 0
    """Generated tokens inside ``prefill_token_ids`` (non-zero when resumed after preemption)."""
    lora_request: LoRARequest | None = None
    """The adapter the request runs with (None: the base model)."""


@dataclass
class CachedRequestData:
    """Running requests that already own a slot. Parallel lists, one entry per request."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[BlockIds | None] = field(default_factory=list)
    """Blocks appended this step, or None when the request got no new block."""
    num_computed_tokens: list[int] = field(default_factory=list)
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """req_id -> tokens the runner has not seen, placed from the request's
    ``num_computed_tokens`` on and run like its prompt (a draft model's runner catching up with
    the tokens its target appended); the scheduler never sends any."""

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    """req_id -> tokens to run this step (1 for a decode, a chunk for a prefill)."""
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    """Requests that finished or were aborted since the last step: the runner frees their slots."""
    preempted_req_ids: set[str] = field(default_factory=set)
    """Requests preempted this step: the runner frees their slots; they return as new requests."""
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    """Speculative decoding: req_id -> its drafts, which follow its last token in its
    ``num_scheduled_tokens`` (1 + len(drafts)); empty when no request drafts."""
    grammar_bitmask: GrammarBitmask | None = None
    """Structured outputs, where the executor runs a step as one call (tensor parallelism):
    the constrained requests' masks, filled by the engine core before it sends the plan."""

    @staticmethod
    def empty() -> SchedulerOutput:
        return SchedulerOutput([], CachedRequestData(), {}, 0, set())


@dataclass
class LogprobsLists:
    """Per sampled row: ``token_ids[i]`` and ``logprobs[i]`` hold the sampled token first, then
    the top-N; ``ranks[i]`` is the sampled token's rank (1 = most likely)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    """One step's result from the runner, in batch order."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    """Per request: the new token(s); empty for a prefill chunk that does not finish the prompt.
    A request that verified drafts gets its accepted drafts, then the target's next token."""
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    """req_id -> one row per sampled token, for requests that asked for logprobs."""
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    """req_id -> one row per prompt position computed this step (position 0 has none)."""

    @staticmethod
    def empty() -> ModelRunnerOutput:
        return ModelRunnerOutput([], [])


@dataclass
class EngineCoreOutput:
    """What the scheduler reports for one request after a step (new tokens, finish)."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: str | None = None
    """stop | length | abort, or None while running."""
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
