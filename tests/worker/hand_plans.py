"""Hand-built SchedulerOutputs for driving the runner without a scheduler (tests only).

``HandScheduler`` hands out block ids from a counter (block 0 stays the null block) and tracks
each request's computed tokens the way the scheduler does: a step's tokens count as computed
from the next plan on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from pagedserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve.math_utils import cdiv
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.model_runner import ModelRunner


def random_prompt(n: int, seed: int, vocab_size: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n,), generator=gen).tolist()


def hf_greedy(hf: PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` alone (the correctness oracle)."""
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def run_step(runner: ModelRunner, plan: SchedulerOutput, outputs: dict[str, list[int]]) -> dict:
    """One step; appends each request's new tokens to ``outputs``; returns them by req_id."""
    runner.execute_model(plan)
    result = runner.sample_tokens()
    new = dict(zip(result.req_ids, result.sampled_token_ids, strict=True))
    for req_id, tokens in new.items():
        outputs.setdefault(req_id, []).extend(tokens)
    return new


@dataclass
class _Req:
    num_blocks: int = 0
    num_computed: int = 0
    num_scheduled: int = 0


@dataclass
class HandScheduler:
    block_size: int
    next_block: int = 1
    reqs: dict[str, _Req] = field(default_factory=dict)

    def _blocks_for(self, req: _Req, num_tokens: int) -> list[int]:
        need = cdiv(req.num_computed + num_tokens, self.block_size) - req.num_blocks
        ids = list(range(self.next_block, self.next_block + max(need, 0)))
        self.next_block += len(ids)
        req.num_blocks += len(ids)
        return ids

    def step(
        self,
        new: list[tuple[str, list[int], int]] | None = None,
        running: list[tuple[str, int]] | None = None,
        finished: set[str] | None = None,
        preempted: set[str] | None = None,
        params: dict[str, SamplingParams] | None = None,
        num_prompt_tokens: dict[str, int] | None = None,
    ) -> SchedulerOutput:
        """new: (req_id, prefill tokens, tokens to run); running: (req_id, tokens to run)."""
        for req in self.reqs.values():  # last step's tokens are computed now
            req.num_computed += req.num_scheduled
            req.num_scheduled = 0
        for req_id in (finished or set()) | (preempted or set()):
            self.reqs.pop(req_id, None)  # a preempted request comes back as a new one
        new_reqs, cached, num_scheduled = [], CachedRequestData(), {}
        for req_id, tokens, n in new or []:
            req = self.reqs[req_id] = _Req(num_scheduled=n)
            new_reqs.append(NewRequestData(
                req_id=req_id,
                prefill_token_ids=list(tokens),
                num_prompt_tokens=(num_prompt_tokens or {}).get(req_id, len(tokens)),
                sampling_params=(params or {}).get(req_id, SamplingParams(temperature=0.0)),
                block_ids=(self._blocks_for(req, n),),
                num_computed_tokens=0,
            ))
            num_scheduled[req_id] = n
        for req_id, n in running or []:
            req = self.reqs[req_id]
            blocks = self._blocks_for(req, n)
            cached.req_ids.append(req_id)
            cached.new_block_ids.append((blocks,) if blocks else None)
            cached.num_computed_tokens.append(req.num_computed)
            req.num_scheduled = n
            num_scheduled[req_id] = n
        return SchedulerOutput(new_reqs, cached, num_scheduled, sum(num_scheduled.values()),
                               set(finished or set()), set(preempted or set()))
