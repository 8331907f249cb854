"""A model-free engine core for the engine-process and AsyncLLM tests.

Each step gives every request one token, ``(last token + 1) % VOCAB_SIZE`` (so an output is
predictable from its prompt), and finishes it at ``max_tokens``. With ``logprobs`` asked for,
the top candidates are ``last + 1, last + 2, ...`` at log-probabilities ``-0.1, -1.1, ...``.
A prompt holding ``CRASH_TOKEN`` makes the next step raise, to test how an engine failure
reaches the API.
It keeps the ``EngineCore`` interface the engine process relies on.
"""

from __future__ import annotations

import time

from pagedserve.config import EngineConfig
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.sched_output import EngineCoreOutput, LogprobsLists
from pagedserve.core.stats import SchedulerStats

VOCAB_SIZE = 384
MAX_MODEL_LEN = 128
CRASH_TOKEN = 383
NUM_BLOCKS = 64
STEP_SECONDS = 0.002
"""Each step sleeps this long, like a tiny model on a CPU."""


def expected_tokens(prompt_token_ids: list[int], n: int) -> list[int]:
    last = prompt_token_ids[-1]
    return [(last + 1 + i) % VOCAB_SIZE for i in range(n)]


class FakeCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.requests: dict[str, Request] = {}
        self.generation_tokens = 0
        self.prompt_tokens = 0

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len or MAX_MODEL_LEN

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in the scheduler")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"prompt_token_ids: {request.num_prompt_tokens} tokens > max_model_len"
            )
        self.requests[request.request_id] = request

    def _finish(self, req_ids: list[str], status: RequestStatus) -> list[EngineCoreOutput]:
        outputs = []
        for req_id in req_ids:
            request = self.requests.pop(req_id, None)
            if request is not None:
                request.status = status
                outputs.append(EngineCoreOutput(req_id, [], finish_reason=status.finish_reason))
        return outputs

    def abort_requests(self, req_ids: list[str]) -> list[EngineCoreOutput]:
        return self._finish(list(req_ids), RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> list[EngineCoreOutput]:
        return self._finish(list(req_ids), status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.requests),
            num_waiting=0,
            kv_cache_usage=len(self.requests) / NUM_BLOCKS,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_preemptions=0,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
        )

    def step(self) -> list[EngineCoreOutput]:
        time.sleep(STEP_SECONDS)
        outputs = []
        for request in list(self.requests.values()):
            if CRASH_TOKEN in request.prompt_token_ids:
                raise RuntimeError(f"fake crash on request {request.request_id}")
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.status = RequestStatus.RUNNING
                self.prompt_tokens += request.num_prompt_tokens
            token = (request.all_token_ids[-1] + 1) % VOCAB_SIZE
            request.append_output_token_ids([token])
            self.generation_tokens += 1
            finish = None
            if request.num_output_tokens >= request.max_tokens:
                finish = "length"
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                del self.requests[request.request_id]
            outputs.append(EngineCoreOutput(request.request_id, [token], _logprobs(request, token),
                                            finish_reason=finish))
        return outputs


def _logprobs(request: Request, token: int) -> LogprobsLists | None:
    """The sampled ``token`` (the most likely) first, then the top ``logprobs`` candidates."""
    k = request.sampling_params.logprobs
    if k is None:
        return None
    top = [(token + i) % VOCAB_SIZE for i in range(k)]
    values = [-0.1 - i for i in range(k)]
    return LogprobsLists([[token, *top]], [[-0.1, *values]], [1])

