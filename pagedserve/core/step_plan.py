"""StepPlan: what one ``Scheduler.schedule()`` call decides, and its SchedulerOutput form."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.core.block_pool import KVCacheBlock
from pagedserve.core.request import Request
from pagedserve.core.sched_output import (
    BlockIds,
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)


@dataclass
class StepPlan:
    """Requests scheduled so far in one step and the token budget left.

    Invariant: ``sum(num_scheduled_tokens.values()) + token_budget`` is the step's budget.
    """

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)
    """Admitted from the waiting queue (new, or resumed after preemption)."""
    running_reqs: list[Request] = field(default_factory=list)
    new_blocks: dict[str, list[KVCacheBlock]] = field(default_factory=dict)
    """Running request id -> blocks allocated this step."""
    preempted: list[Request] = field(default_factory=list)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Running request id -> the drafts it verifies this step (speculative decoding)."""

    def add_running(
        self, request: Request, num_tokens: int, new_blocks: list[KVCacheBlock]
    ) -> None:
        self.running_reqs.append(request)
        self.new_blocks[request.request_id] = new_blocks
        self._take(request, num_tokens)

    def add_new(self, request: Request, num_tokens: int) -> None:
        self.new_reqs.append(request)
        self._take(request, num_tokens)

    def _take(self, request: Request, num_tokens: int) -> None:
        assert 0 < num_tokens <= self.token_budget, (num_tokens, self.token_budget)
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.token_budget -= num_tokens

    def unschedule(self, request: Request) -> None:
        """Undo ``add_running`` for a request preempted later in the same step (no-op if it
        was not scheduled)."""
        num_tokens = self.num_scheduled_tokens.pop(request.request_id, None)
        if num_tokens is None:
            return
        self.token_budget += num_tokens
        self.running_reqs.remove(request)
        del self.new_blocks[request.request_id]
        self.spec_token_ids.pop(request.request_id, None)

    def to_output(
        self, get_block_ids: Callable[[str], BlockIds], finished_req_ids: set[str]
    ) -> SchedulerOutput:
        """The plan as the runner sees it. Call before the requests' ``num_computed_tokens``
        are advanced: the runner gets the pre-step values."""
        new_reqs = [
            NewRequestData(
                req_id=r.request_id,
                prefill_token_ids=list(r.all_token_ids),
                num_prompt_tokens=r.num_prompt_tokens,
                sampling_params=r.sampling_params,
                block_ids=get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
                num_output_tokens=r.num_output_tokens,
                lora_request=r.lora_request,
            )
            for r in self.new_reqs
        ]
        cached = CachedRequestData()
        for r in self.running_reqs:
            blocks = self.new_blocks[r.request_id]
            cached.req_ids.append(r.request_id)
            cached.new_block_ids.append(([b.block_id for b in blocks],) if blocks else None)
            cached.num_computed_tokens.append(r.num_computed_tokens)
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict(self.num_scheduled_tokens),
            total_num_scheduled_tokens=sum(self.num_scheduled_tokens.values()),
            finished_req_ids=finished_req_ids,
            preempted_req_ids={r.request_id for r in self.preempted},
            scheduled_spec_decode_tokens=self.spec_token_ids,
        )
