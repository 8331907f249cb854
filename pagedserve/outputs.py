"""The public response types: what ``LLM.generate`` returns and the server streams.

Names and fields mirror vLLM's ``vllm/outputs.py`` so code written against vLLM's offline API
reads these unchanged. Pure data: no torch, no tokenizer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RequestOutputKind(enum.Enum):
    """How much of a request's output each ``RequestOutput`` carries (vLLM's names)."""

    CUMULATIVE = 0
    """Everything generated so far, every step."""
    DELTA = 1
    """Only what is new since the previous output (streaming)."""
    FINAL_ONLY = 2
    """One output, when every completion of the request has finished (``LLM.generate``)."""


@dataclass
class Logprob:
    """One token's log probability at one position."""

    logprob: float
    rank: int | None = None
    """1 = the most likely token at that position."""
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
"""Per generated token: token id -> Logprob (the sampled token and the top-N)."""
PromptLogprobs = list[dict[int, Logprob] | None]
"""Per prompt token; the first entry is None (nothing precedes the first token)."""


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.monotonic()``) of one request's life, seen by the frontend."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One completion (of the ``n`` a request asked for)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    """Sum of the sampled tokens' logprobs; None unless ``logprobs`` was asked for."""
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    """stop | length | abort, or None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the completion; None for EOS or length."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its ``n`` completions (ordered by index)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None
    """Prompt tokens served from the prefix cache (first completion)."""

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, outputs={self.outputs}, "
            f"finished={self.finished})"
        )
