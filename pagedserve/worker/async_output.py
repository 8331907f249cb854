"""The step's result on its way to the host (docs/architecture.md#step-8-async-output).

On CUDA the sampled ids and logprobs are copied into pinned host memory on a side stream that
first waits for the main stream; an event marks the end of the copy. ``get_output`` waits on
that event: the only place the host waits for the device. The AsyncOutput keeps references to
the device tensors until then, because the copy reads them on another stream.

On the CPU the tensors are already in host memory; they are copied so later steps cannot
change them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.core.sched_output import LogprobsLists, ModelRunnerOutput
from pagedserve.sample import LogprobsTensors, SamplerOutput

Copy = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class PromptLogprobsSpan:
    """Rows ``start:end`` of the step's prompt-logprobs tensors belong to ``req_id``, which
    asked for ``num_logprobs`` top tokens."""

    req_id: str
    start: int
    end: int
    num_logprobs: int


def _lists(t: LogprobsTensors, rows: slice, num_logprobs: int) -> LogprobsLists:
    cols = slice(0, num_logprobs + 1)
    return LogprobsLists(
        token_ids=t.token_ids[rows, cols].tolist(),
        logprobs=t.logprobs[rows, cols].tolist(),
        ranks=t.ranks[rows].tolist(),
    )


class AsyncOutput:
    def __init__(
        self,
        req_ids: list[str],
        sample_rows: list[int],
        num_logprobs: list[int | None],
        sampler_output: SamplerOutput | None,
        prompt_logprobs: LogprobsTensors | None,
        prompt_spans: list[PromptLogprobsSpan],
        copy_stream: torch.cuda.Stream | None,
    ) -> None:
        """``sample_rows[j]``: the batch row of sampler row j (ascending); ``num_logprobs[j]``:
        its requested top-k (None: no logprobs), read only when the sampler returned logprobs
        (may be empty otherwise). ``copy_stream`` None: tensors are on the host."""
        self.req_ids = req_ids
        self.sample_rows = sample_rows
        self.num_logprobs = num_logprobs
        self.prompt_spans = prompt_spans
        # Keeps the device tensors alive until the copy of them is done.
        self._device_refs: tuple[SamplerOutput | None, LogprobsTensors | None] | None = (
            sampler_output, prompt_logprobs)
        self._event: torch.cuda.Event | None = None
        self.sampled: torch.Tensor | None = None  # int64 [num_sampled], host
        self.logprobs: LogprobsTensors | None = None  # [num_sampled, k + 1], host
        self.prompt_logprobs: LogprobsTensors | None = None  # [num_prompt_rows, k + 1], host
        if copy_stream is None:
            self._start_copies(sampler_output, prompt_logprobs, _host_clone)
            return
        main_stream = torch.cuda.current_stream()
        self._event = torch.cuda.Event()
        with torch.cuda.stream(copy_stream):
            copy_stream.wait_stream(main_stream)
            self._start_copies(sampler_output, prompt_logprobs, _to_pinned_host)
            self._event.record(copy_stream)

    def _start_copies(
        self,
        sampler_output: SamplerOutput | None,
        prompt_logprobs: LogprobsTensors | None,
        copy: Copy,
    ) -> None:
        if sampler_output is not None:
            self.sampled = copy(sampler_output.sampled_token_ids)
            if sampler_output.logprobs is not None:
                self.logprobs = _copy_logprobs(sampler_output.logprobs, copy)
        if prompt_logprobs is not None:
            self.prompt_logprobs = _copy_logprobs(prompt_logprobs, copy)

    def get_output(self) -> ModelRunnerOutput:
        if self._event is not None:
            self._event.synchronize()
        self._device_refs = None
        sampled_token_ids = self._sampled_token_ids()
        logprobs: dict[str, LogprobsLists] = {}
        if self.logprobs is not None:
            for j, row in enumerate(self.sample_rows):
                k = self.num_logprobs[j]
                if k is not None:
                    logprobs[self.req_ids[row]] = _lists(self.logprobs, self._token_rows(j), k)
        prompt_logprobs = {}
        if self.prompt_logprobs is not None:
            for span in self.prompt_spans:
                rows = slice(span.start, span.end)
                prompt_logprobs[span.req_id] = _lists(self.prompt_logprobs, rows,
                                                      span.num_logprobs)
        return ModelRunnerOutput(
            req_ids=list(self.req_ids),
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _token_rows(self, j: int) -> slice:
        """The rows of sampler row j's tokens in ``sampled`` and ``logprobs``."""
        return slice(j, j + 1)

    def _sampled_token_ids(self) -> list[list[int]]:
        """One list per batch row: its sampled token, or empty (a partial prefill chunk)."""
        if self.sampled is None:
            return [[] for _ in self.req_ids]
        tokens = self.sampled.tolist()
        if len(tokens) == len(self.req_ids):  # every row sampled: rows 0..n-1 in order
            return [[token] for token in tokens]
        sampled_token_ids: list[list[int]] = [[] for _ in self.req_ids]
        for row, token in zip(self.sample_rows, tokens, strict=True):
            sampled_token_ids[row] = [token]
        return sampled_token_ids


def _host_clone(t: torch.Tensor) -> torch.Tensor:
    return t.clone()


def _to_pinned_host(t: torch.Tensor) -> torch.Tensor:
    # A non-blocking device-to-host copy lands in pinned memory allocated by torch.
    return t.to("cpu", non_blocking=True)


def _copy_logprobs(t: LogprobsTensors, copy: Copy) -> LogprobsTensors:
    return LogprobsTensors(token_ids=copy(t.token_ids), logprobs=copy(t.logprobs),
                           ranks=copy(t.ranks))
