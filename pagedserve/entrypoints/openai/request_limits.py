"""Per-request cost caps a server operator sets (``--max-n``, ``--max-prompts-per-request``,
``--max-completions-per-request``, ``--max-logprobs``): one request must not fan out into so
many engine requests, or so large a response, that every other client waits. A request past
a cap is refused with 400 naming the field, before anything is tokenized."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.entrypoints.openai.errors import bad_request
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

DEFAULT_MAX_N = 32
DEFAULT_MAX_PROMPTS_PER_REQUEST = 64
DEFAULT_MAX_COMPLETIONS_PER_REQUEST = 256
DEFAULT_MAX_LOGPROBS = 20


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = DEFAULT_MAX_N
    """Completions per prompt (``n``)."""
    max_prompts: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    """Prompts in one completions request (``prompt`` as a list)."""
    max_completions: int = DEFAULT_MAX_COMPLETIONS_PER_REQUEST
    """Prompts x ``n``: the engine requests one HTTP request becomes."""
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    """Top log-probabilities per token (``logprobs``, ``top_logprobs``)."""

    def check_completion(self, request: CompletionRequest) -> None:
        num_prompts = len(request.prompts())
        _check_cap("prompt", num_prompts, self.max_prompts, "prompts per request",
                   "--max-prompts-per-request")
        self._check_n(request.n)
        _check_cap("n", num_prompts * request.n, self.max_completions,
                   "completions per request (prompts x n)", "--max-completions-per-request")
        if request.logprobs is not None:
            self._check_logprobs("logprobs", request.logprobs)
        if request.prompt_logprobs is not None:
            self._check_logprobs("prompt_logprobs", request.prompt_logprobs)

    def check_chat(self, request: ChatCompletionRequest) -> None:
        self._check_n(request.n)
        if request.top_logprobs is not None:
            self._check_logprobs("top_logprobs", request.top_logprobs)
        if request.prompt_logprobs is not None:
            self._check_logprobs("prompt_logprobs", request.prompt_logprobs)

    def _check_n(self, n: int) -> None:
        _check_cap("n", n, self.max_n, "completions per prompt", "--max-n")
        _check_cap("n", n, self.max_completions, "completions per request",
                   "--max-completions-per-request")

    def _check_logprobs(self, field: str, value: int) -> None:
        _check_cap(field, value, self.max_logprobs, "log-probabilities per token",
                   "--max-logprobs")


def _check_cap(field: str, value: int, cap: int, what: str, option: str) -> None:
    if value > cap:
        raise bad_request(
            f"{field}: {value} {what} is more than this server allows ({cap}, {option})",
            param=field,
            code="invalid_value",
        )
