"""The result of a step that verified drafts, on its way to the host: like ``AsyncOutput``,
with several tokens per sampling row (its accepted drafts, then the target's token)."""

from __future__ import annotations

import torch

from pagedserve.core.sched_output import ModelRunnerOutput
from pagedserve.sample import LogprobsTensors, SamplerOutput
from pagedserve.worker.async_output import AsyncOutput, Copy, PromptLogprobsSpan


class VerifiedOutput(AsyncOutput):
    def __init__(
        self,
        req_ids: list[str],
        sample_rows: list[int],
        num_logprobs: list[int | None],
        sampler_output: SamplerOutput,
        num_accepted: torch.Tensor,  # int64 [num_sampled], device
        offsets: list[int],
        prompt_logprobs: LogprobsTensors | None,
        prompt_spans: list[PromptLogprobsSpan],
        copy_stream: torch.cuda.Stream | None,
    ) -> None:
        """``sampler_output`` holds every logits row's sample (and logprobs); sampling row j
        owns rows ``offsets[j]`` to ``offsets[j] + num_accepted[j]`` of them."""
        self._num_accepted_device: torch.Tensor | None = num_accepted
        self.num_accepted: torch.Tensor | None = None  # int64 [num_sampled], host
        self.offsets = offsets
        self._accepted: list[int] = []
        super().__init__(req_ids, sample_rows, num_logprobs, sampler_output, prompt_logprobs,
                         prompt_spans, copy_stream)

    def _start_copies(self, sampler_output: SamplerOutput | None,
                      prompt_logprobs: LogprobsTensors | None, copy: Copy) -> None:
        super()._start_copies(sampler_output, prompt_logprobs, copy)
        assert self._num_accepted_device is not None
        self.num_accepted = copy(self._num_accepted_device)

    def get_output(self) -> ModelRunnerOutput:
        output = super().get_output()  # waits for the copies
        self._num_accepted_device = None
        return output

    def _token_rows(self, j: int) -> slice:
        if not self._accepted:
            assert self.num_accepted is not None
            self._accepted = self.num_accepted.tolist()
        start = self.offsets[j]
        return slice(start, start + self._accepted[j] + 1)

    def _sampled_token_ids(self) -> list[list[int]]:
        assert self.sampled is not None
        tokens = self.sampled.tolist()
        sampled_token_ids: list[list[int]] = [[] for _ in self.req_ids]
        for j, row in enumerate(self.sample_rows):
            rows = self._token_rows(j)
            sampled_token_ids[row] = tokens[rows.start : rows.stop]
        return sampled_token_ids
