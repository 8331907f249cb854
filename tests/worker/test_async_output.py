"""AsyncOutput on the CPU: the host result, per request, in batch order."""

from __future__ import annotations

import torch

from pagedserve.core.sched_output import LogprobsLists
from pagedserve.sample import LogprobsTensors, SamplerOutput
from pagedserve.worker.async_output import AsyncOutput, PromptLogprobsSpan


def test_rows_land_on_their_requests_and_later_changes_do_not_leak() -> None:
    sampled = torch.tensor([11, 22], dtype=torch.int64)
    logprobs = LogprobsTensors(
        token_ids=torch.tensor([[11, 3, 4], [22, 5, 6]]),
        logprobs=torch.tensor([[-0.5, -0.125, -0.25], [-1.0, -0.375, -0.625]]),
        ranks=torch.tensor([2, 3]),
    )
    prompt = LogprobsTensors(
        token_ids=torch.tensor([[7, 1, 2], [8, 1, 2], [9, 2, 1]]),
        logprobs=torch.tensor(
            [[-1.0, -0.125, -0.25], [-2.0, -0.125, -0.25], [-3.0, -0.125, -0.25]]
        ),
        ranks=torch.tensor([4, 5, 6]),
    )
    out = AsyncOutput(
        req_ids=["D", "P", "Q"],
        sample_rows=[0, 2],  # P is a partial prefill chunk
        num_logprobs=[1, None],
        sampler_output=SamplerOutput(sampled, logprobs),
        prompt_logprobs=prompt,
        prompt_spans=[PromptLogprobsSpan("P", 0, 2, 0), PromptLogprobsSpan("Q", 2, 3, 2)],
        copy_stream=None,
    )
    sampled.fill_(0)  # the runner's tensors may change once the copy has started
    result = out.get_output()
    assert result.req_ids == ["D", "P", "Q"]
    assert result.sampled_token_ids == [[11], [], [22]]
    assert result.logprobs == {"D": LogprobsLists([[11, 3]], [[-0.5, -0.125]], [2])}
    assert result.prompt_logprobs == {
        "P": LogprobsLists([[7], [8]], [[-1.0], [-2.0]], [4, 5]),
        "Q": LogprobsLists([[9, 2, 1]], [[-3.0, -0.125, -0.25]], [6]),
    }


def test_every_row_sampled_and_no_logprobs() -> None:
    out = AsyncOutput(
        req_ids=["A", "B", "C"],
        sample_rows=[0, 1, 2],
        num_logprobs=[],  # not read: the sampler computed no logprobs
        sampler_output=SamplerOutput(torch.tensor([5, 6, 7]), None),
        prompt_logprobs=None,
        prompt_spans=[],
        copy_stream=None,
    )
    result = out.get_output()
    assert result.sampled_token_ids == [[5], [6], [7]]
    assert result.logprobs == {} and result.prompt_logprobs == {}
