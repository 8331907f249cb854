"""The dummy steps that CUDA-graph captures and the memory profile run: plans built like a
scheduler's, run through the runner's own step path, so a capture records the addresses a real
step reads."""

from __future__ import annotations

from typing import Protocol

from pagedserve.core.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedserve.math_utils import cdiv
from pagedserve.sampling_params import SamplingParams

GREEDY_ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)
"""The sampling of every dummy request: one greedy token."""
Plans = tuple[SchedulerOutput, SchedulerOutput]
"""A step's plan and the plan that frees its requests again."""


def dummy_plans(prompt_lens: list[int], block_size: int, sampling_params: SamplingParams,
                name: str) -> Plans:
    """A step of new requests ``{name}-{i}`` with prompts of token 0 of these lengths, each
    finishing its prefill in the step (blocks from 1 up: block 0 is the null block), and the
    plan that frees them again."""
    new_reqs, num_scheduled, next_block = [], {}, 1
    for i, n in enumerate(prompt_lens):
        req_id = f"{name}-{i}"
        blocks = cdiv(n, block_size)
        new_reqs.append(NewRequestData(
            req_id=req_id, prefill_token_ids=[0] * n, num_prompt_tokens=n,
            sampling_params=sampling_params,
            block_ids=(list(range(next_block, next_block + blocks)),), num_computed_tokens=0,
        ))  # fmt: skip
        num_scheduled[req_id] = n
        next_block += blocks
    run = SchedulerOutput(new_reqs, CachedRequestData(), num_scheduled, sum(prompt_lens), set())
    finish = SchedulerOutput([], CachedRequestData(), {}, 0, set(num_scheduled))
    return run, finish


def verify_plans(num_reqs: int, query_len: int, block_size: int) -> Plans:
    """A step of ``num_reqs`` requests past a one-token prompt, each verifying
    ``query_len - 1`` drafts (token 0), and the plan that frees them again."""
    blocks = cdiv(1 + query_len, block_size)
    new_reqs, num_scheduled, drafts = [], {}, {}
    for i in range(num_reqs):
        req_id = f"verify-{i}"
        new_reqs.append(NewRequestData(
            req_id=req_id, prefill_token_ids=[0], num_prompt_tokens=1,
            sampling_params=GREEDY_ONE_TOKEN, block_ids=(list(range(1 + i * blocks, 1 + (i + 1) * blocks)),),
            num_computed_tokens=1))
        num_scheduled[req_id] = query_len
        drafts[req_id] = [0] * (query_len - 1)
    run = SchedulerOutput(new_reqs, CachedRequestData(), num_scheduled, num_reqs * query_len,
                          set(), scheduled_spec_decode_tokens=drafts)
    finish = SchedulerOutput([], CachedRequestData(), {}, 0, set(num_scheduled))
    return run, finish


class StepRunner(Protocol):
    """What captures run their plans through: the runner's own step path."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> None: ...

    def sample_tokens(self) -> ModelRunnerOutput: ...


def run_plans(runner: StepRunner, plans: Plans) -> None:
    run, finish = plans
    runner.execute_model(run)
    runner.sample_tokens()
    runner.execute_model(finish)
