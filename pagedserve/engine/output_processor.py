"""Engine-core outputs -> ``RequestOutput``: detokenize, find stop strings, gather logprobs,
and fold the ``n`` child requests of a request back into one output.

The engine core knows token ids only; stop *strings* are found here. When one appears, the
output processor finishes the completion itself and returns the child id in
``reqs_to_finish``: the caller must then finish it in the core
(``engine_core.finish_requests(ids, RequestStatus.FINISHED_STOPPED)``) so its blocks are freed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.core.sched_output import EngineCoreOutput
from pagedserve.engine.detokenizer import IncrementalDetokenizer, decode_logprobs
from pagedserve.engine.input_processor import ProcessedRequest
from pagedserve.outputs import (
    CompletionOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
    SampleLogprobs,
)


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    """One per request that has something to report this step (per its output kind)."""
    reqs_to_finish: list[str] = field(default_factory=list)
    """Child request ids stopped by a stop string: finish them in the engine core."""


class CompletionState:
    """One child request: its tokens, text and logprobs so far."""

    def __init__(self, index: int, req_id: str, tokenizer: Any, processed: ProcessedRequest):
        params = processed.requests[index].sampling_params
        self.index = index
        self.req_id = req_id
        # No text without a tokenizer (skip_tokenizer_init) or with detokenize=False.
        self.tokenizer = tokenizer if params.detokenize else None
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, processed.prompt_token_ids, params)
            if self.tokenizer is not None
            else None
        )
        self.want_logprobs = params.logprobs is not None
        self.token_ids: list[int] = []
        self.logprobs: SampleLogprobs = []
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_reported_tokens = 0
        """Tokens (and logprob rows) already sent in DELTA mode."""
        self.reported_finish = False
        self.updated = False
        """Took an engine-core output since its parent last reported (read in DELTA mode)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: EngineCoreOutput) -> str | None:
        """Take one step's output; return the stop string if the text now contains one."""
        new_token_ids = out.new_token_ids
        self.updated = True
        self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        stop_str = None
        detokenizer = self.detokenizer
        # No text (skip_tokenizer_init, detokenize=False): no stop strings.
        if detokenizer is not None and new_token_ids:
            if len(new_token_ids) == 1 or not detokenizer.stop:
                stop_str = detokenizer.update(new_token_ids, out.finish_reason == "stop")
            else:  # several tokens at once (speculative decoding)
                stop_str, num_kept = self._detokenize_each(new_token_ids,
                                                           out.finish_reason == "stop")
                new_token_ids = new_token_ids[:num_kept]
            if stop_str is not None:
                self.finish_reason, self.stop_reason = "stop", stop_str
        self.token_ids.extend(new_token_ids)
        if out.new_logprobs is not None and self.want_logprobs:
            rows = out.new_logprobs
            self.logprobs.extend(decode_logprobs(self.tokenizer, rows)[: len(new_token_ids)])
            self.cumulative_logprob += sum(row[0] for row in rows.logprobs[: len(new_token_ids)])
        return stop_str

    def _detokenize_each(self, new_token_ids: list[int],
                         stop_terminated: bool) -> tuple[str | None, int]:
        """Feed the detokenizer one token at a time; returns the stop string found, if any,
        and the tokens kept: a stop string may end before the last of several tokens that
        came at once (those after it are dropped, as if never generated)."""
        detokenizer = self.detokenizer
        assert detokenizer is not None
        num_new = len(new_token_ids)
        for i, token_id in enumerate(new_token_ids):
            stop_str = detokenizer.update([token_id], stop_terminated and i == num_new - 1)
            if stop_str is not None:
                return stop_str, i + 1
        return None, num_new

    def make_output(self, delta: bool) -> CompletionOutput:
        start = self.num_reported_tokens if delta else 0
        if delta:
            self.num_reported_tokens = len(self.token_ids)
            self.reported_finish = self.finished
        text = (
            self.detokenizer.get_next_output_text(self.finished, delta)
            if self.detokenizer is not None
            else ""
        )
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=self.token_ids[start:],
            cumulative_logprob=self.cumulative_logprob if self.want_logprobs else None,
            logprobs=self.logprobs[start:] if self.want_logprobs else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class RequestState:
    """A user request: its prompt and the completions of its ``n`` children."""

    def __init__(
        self, processed: ProcessedRequest, tokenizer: Any, output_kind: RequestOutputKind
    ) -> None:
        self.request_id = processed.request_id
        self.prompt = processed.prompt
        self.prompt_token_ids = processed.prompt_token_ids
        self.output_kind = output_kind
        self.tokenizer = tokenizer
        self.completions = [
            CompletionState(i, r.request_id, tokenizer, processed)
            for i, r in enumerate(processed.requests)
        ]
        self.want_prompt_logprobs = processed.sampling_params.prompt_logprobs is not None
        self.prompt_logprobs: PromptLogprobs = [None]
        self.metrics = RequestMetrics(arrival_time=processed.arrival_time)
        self.num_cached_tokens: int | None = None

    @property
    def finished(self) -> bool:
        for completion in self.completions:  # a loop, not all(...): read every step
            if completion.finish_reason is None:
                return False
        return True

    def record(self, completion: CompletionState, out: EngineCoreOutput, now: float) -> None:
        """Per-request bookkeeping of one child output: metrics, prompt logprobs."""
        if out.new_token_ids:
            if self.metrics.first_token_time is None:
                self.metrics.first_token_time = now
            self.metrics.last_token_time = now
            self.metrics.num_generation_tokens += len(out.new_token_ids)
        if completion.index == 0:
            self.num_cached_tokens = out.num_cached_tokens
            if self.want_prompt_logprobs and out.new_prompt_logprobs is not None:
                self.prompt_logprobs.extend(
                    decode_logprobs(self.tokenizer, out.new_prompt_logprobs)
                )

    def make_output(self) -> RequestOutput | None:
        """The output to report after a step in which some completions were ``updated``; None
        while a FINAL_ONLY request is unfinished."""
        finished = self.finished
        if self.output_kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None  # the common case while generating: nothing to build
        if finished:
            self.metrics.finished_time = time.monotonic()
        if self.output_kind is RequestOutputKind.FINAL_ONLY:
            completions = [c.make_output(delta=False) for c in self.completions]
        elif self.output_kind is RequestOutputKind.DELTA:
            completions = [
                c.make_output(delta=True)
                for c in self.completions
                if c.updated and not c.reported_finish
            ]
            for c in self.completions:
                c.updated = False
        else:
            completions = [c.make_output(delta=False) for c in self.completions]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=self.prompt_logprobs if self.want_prompt_logprobs else None,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
        )


class OutputProcessor:
    """Holds every unfinished request's output state; turns engine-core outputs into
    ``RequestOutput`` objects.

    Usage per step: ``result = process_outputs(engine_core.step())``, then
    ``engine_core.finish_requests(result.reqs_to_finish, RequestStatus.FINISHED_STOPPED)``.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        """Parent request id -> state."""
        self._children: dict[str, tuple[RequestState, CompletionState]] = {}
        """Unfinished child request id -> (its parent's state, its completion)."""

    def add_request(
        self,
        processed: ProcessedRequest,
        output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
    ) -> None:
        if processed.request_id in self.request_states:
            raise ValueError(f"request_id: {processed.request_id!r} is already running")
        state = RequestState(processed, self.tokenizer, output_kind)
        self.request_states[state.request_id] = state
        for completion in state.completions:
            self._children[completion.req_id] = (state, completion)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def process_outputs(self, outputs: Iterable[EngineCoreOutput]) -> OutputProcessorOutput:
        """Outputs of children no longer tracked (aborted, or stopped by a stop string in an
        earlier step) are ignored."""
        now = time.monotonic()
        updated: dict[str, RequestState] = {}
        """Parents with an updated completion, in the order of their first output."""
        result = OutputProcessorOutput([])
        children = self._children
        for out in outputs:
            entry = children.get(out.req_id)
            if entry is None:
                continue
            state, completion = entry
            stop_str = completion.update(out)
            state.record(completion, out, now)
            if stop_str is not None and out.finish_reason is None:
                result.reqs_to_finish.append(out.req_id)  # finished here, not yet in the core
            if completion.finish_reason is not None:
                del children[out.req_id]
            updated[state.request_id] = state
        for request_id, state in updated.items():
            request_output = state.make_output()
            if request_output is None:
                continue  # FINAL_ONLY and not finished
            result.request_outputs.append(request_output)
            if request_output.finished:
                del self.request_states[request_id]
        return result

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Forget requests (parent ids) without reporting them (e.g. the client went away);
        returns the child ids to abort in the engine core."""
        child_ids: list[str] = []
        for request_id in request_ids:
            state = self.request_states.pop(request_id, None)
            if state is None:
                continue
            for completion in state.completions:
                if self._children.pop(completion.req_id, None) is not None:
                    child_ids.append(completion.req_id)
        return child_ids
