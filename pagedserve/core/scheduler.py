"""Scheduler: continuous batching with chunked prefill and preemption by recompute (vLLM V1).

There is no prefill phase and no decode phase. Every request has ``num_computed_tokens`` that
catches up with its token count; a step gives each request some tokens out of one budget:

1. running requests first, in order (a decode takes 1 token, a prefill chunk what is left);
   when blocks run out, the lowest-priority (``priority`` policy) or latest-arrived (``fcfs``)
   running request is preempted: blocks freed, back to the front of the waiting queue, its
   generated tokens kept so it resumes where it was after recomputing them;
2. then waiting requests (new or preempted), after a prefix-cache lookup, unless a preemption
   happened this step (blocks are short) or ``max_num_seqs`` requests are running. Under the
   ``reserve`` and ``ratio`` admission policies (``core/admission.py``; reserve is the
   default) a request is admitted only if the running requests keep a reserve of blocks for
   their future tokens; under ``greedy`` whenever its first blocks are free.

A constrained request (structured outputs) waits in ``waiting_for_grammar`` until its grammar
is compiled, then joins the waiting queue; its matcher advances with every token appended
(docs/architecture.md#structured-outputs).

``schedule()`` advances ``num_computed_tokens`` as soon as it plans a step, so the next step can
be planned before this one's sampled tokens arrive (async scheduling: the unknown tokens are
counted in ``Request.num_output_placeholders``).

Speculative decoding (docs/architecture.md#speculative-decoding): a decoding request with no
step in flight may get drafts from the proposer; it is scheduled for 1 + k tokens (its last
token, then the drafts) and ``num_computed_tokens`` advances by all of them. When the step's
tokens come back (the accepted drafts plus one token of the target's), the rejected drafts are
taken back off ``num_computed_tokens``: their KV slots are rewritten by later steps, and only
verified tokens ever get hashed into the prefix cache (hashes cover appended tokens only).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from pagedserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagedserve.core.admission import RatioAdmission, make_admission
from pagedserve.core.block_pool import KVCacheBlock
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.request_queue import make_request_queue
from pagedserve.core.sched_output import (
    EngineCoreOutput,
    LogprobsLists,
    ModelRunnerOutput,
    SchedulerOutput,
)
from pagedserve.core.stats import SchedulerStats, SpecDecodeCounts
from pagedserve.core.step_plan import StepPlan
from pagedserve.spec_decode.gate import DraftGate
from pagedserve.spec_decode.proposer import DraftRequest, Proposer, make_proposer

logger = logging.getLogger(__name__)


def check_stop(request: Request, max_model_len: int) -> bool:
    """Whether ``request`` is done after its last appended token; if so, set its finished
    status (and ``stop_reason`` for a stop token). Length caps come first; EOS and stop
    tokens count only once ``min_tokens`` tokens were generated (the stopping token
    included). Stop strings are the detokenizer's: it finishes the request through
    ``Scheduler.finish_requests``."""
    if request.num_tokens >= max_model_len or request.num_output_tokens >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    grammar = request.structured_output
    if grammar is not None and grammar.is_terminated():
        request.status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
        return True
    params = request.sampling_params
    if request.num_output_tokens < params.min_tokens:
        return False
    last_token_id = request.output_token_ids[-1]
    if not params.ignore_eos and last_token_id == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last_token_id in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
        return True
    return False


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        max_model_len: int,
        num_blocks: int,
        max_loras: int = 0,
    ) -> None:
        """``max_loras``: distinct LoRA adapters the running requests may use at once (the
        runner's device slots; 0 where the engine serves none)."""
        _check_limits(scheduler_config, cache_config, max_model_len, num_blocks)
        self.max_loras = max_loras
        self.scheduler_config = scheduler_config
        self.max_model_len = max_model_len
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_config.block_size, max_model_len, cache_config.enable_prefix_caching
        )
        self.requests: dict[str, Request] = {}
        """Every unfinished request, waiting or running."""
        self.waiting = make_request_queue(scheduler_config.policy)
        self.waiting_for_grammar: list[Request] = []
        """Constrained requests whose grammar is still compiling; they join ``waiting`` when
        it is ready, so they hold up no one."""
        self._rejected: list[EngineCoreOutput] = []
        """Outputs of requests aborted before they ran: their grammar failed to compile, or
        the engine core refused them (``reject``)."""
        self.num_constrained_requests = 0
        """Unfinished requests with a grammar: 0 lets the core skip every grammar check."""
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        """Finished since the last ``schedule()``; handed to the runner in the next plan."""
        self.num_preemptions = 0
        self.admission: RatioAdmission | None = make_admission(scheduler_config, max_model_len)
        """None under the ``greedy`` admission policy."""
        self.prompt_tokens = 0
        self.generation_tokens = 0
        spec = scheduler_config.speculative_config
        self.speculative_config: SpeculativeConfig | None = spec
        self.proposer: Proposer | None = None if spec is None else make_proposer(spec)
        """Set by the engine core for ``draft_model`` (it runs on the device)."""
        self.draft_gate = DraftGate(0.0 if spec is None else spec.min_acceptance_rate)
        self.spec_stats = SpecDecodeCounts(0 if spec is None else spec.num_speculative_tokens)

    # ---- requests in and out ------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request_id: {rid!r} is already in the scheduler")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens != 0:
            raise ValueError(f"request {rid!r}: must be new (WAITING), got {request.status.name}")
        if not 0 < request.num_prompt_tokens <= self.max_model_len:
            raise ValueError(
                f"prompt_token_ids: request {rid!r} has {request.num_prompt_tokens} prompt "
                f"tokens, must be between 1 and max_model_len={self.max_model_len}"
            )
        if request.max_tokens < 1:
            raise ValueError(
                f"max_tokens: request {rid!r} must allow >= 1, got {request.max_tokens}"
            )
        if not self.requests and self.admission is not None:
            self.admission.reset()  # a burst after a pause starts cautious, as at start-up
        self.requests[rid] = request
        if request.structured_output is not None:
            self.num_constrained_requests += 1
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar.append(request)
        else:
            self.waiting.add(request)

    def finish_requests(
        self, request_ids: Iterable[str], status: RequestStatus
    ) -> list[EngineCoreOutput]:
        """Finish requests from outside (abort, stop string); unknown or finished ids are ignored."""
        if not status.is_finished:
            raise ValueError(f"status: {status.name} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            request.status = status
            self._free_request(request)
            outputs.append(self._make_engine_output(request, []))
        return outputs

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def _free_request(self, request: Request) -> None:
        """Remove a request whose status is already a finished one; free its blocks now."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting_for_grammar:
            self.waiting_for_grammar.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        if self.proposer is not None:
            self.proposer.finish((request.request_id,))
        if request.structured_output is not None:
            self.num_constrained_requests -= 1

    # ---- one step ------------------------------------------------------------------------

    def _admit_ready_grammars(self) -> None:
        """Move the requests whose grammar compiled into the waiting queue; abort those whose
        grammar failed (their outputs come with the next ``take_rejected``)."""
        still_compiling = []
        for request in self.waiting_for_grammar:
            grammar = request.structured_output
            assert grammar is not None
            if not grammar.is_ready():
                still_compiling.append(request)
                continue
            error = grammar.error()
            if error is None:
                request.status = RequestStatus.WAITING
                self.waiting.add(request)
                continue
            logger.error("request %s: its grammar failed to compile: %s",
                         request.request_id, error)
            request.status = RequestStatus.FINISHED_ABORTED
            del self.requests[request.request_id]
            self.num_constrained_requests -= 1
            self._rejected.append(self._make_engine_output(request, []))
        self.waiting_for_grammar = still_compiling

    def reject(self, request: Request, reason: str) -> None:
        """End a request that never entered the scheduler (its output, ``abort``, comes with
        the next ``take_rejected``)."""
        logger.error("request %s: refused: %s", request.request_id, reason)
        request.status = RequestStatus.FINISHED_ABORTED
        self._rejected.append(self._make_engine_output(request, []))

    def take_rejected(self) -> list[EngineCoreOutput]:
        rejected, self._rejected = self._rejected, []
        return rejected

    def schedule(self) -> SchedulerOutput:
        if self.waiting_for_grammar:
            self._admit_ready_grammars()
        plan = StepPlan(token_budget=self.scheduler_config.max_num_batched_tokens)
        self._schedule_running(plan, self._propose() if self.proposer is not None else None)
        if not plan.preempted:
            self._schedule_waiting(plan)
        if self.admission is not None:
            if plan.preempted:
                self.admission.reset()  # the reserve was too small
            elif plan.num_scheduled_tokens:
                self.admission.decay()
        finished, self.finished_req_ids = self.finished_req_ids, set()
        output = plan.to_output(self.kv_cache_manager.get_block_ids, finished)
        self._advance(plan)
        return output

    def speculating(self) -> bool:
        """Whether the next step may carry drafts: then the engine core plans it with no step
        in flight, so every drafting request's tokens are known. With ngram drafts only while
        some request's last lookup found a match (``Request.draft_hot``): where the text does
        not repeat, steps stay asynchronous and only the lookups run (``_propose``)."""
        spec = self.speculative_config
        if spec is None or len(self.running) > spec.disable_by_batch_size:
            return False
        if self.num_constrained_requests:
            return False
        return spec.method != "ngram" or any(r.draft_hot for r in self.running)

    def _propose(self) -> dict[str, list[int]]:
        """Drafts of the running requests that draft this step (``spec_decode/gate.py``).

        A request with a step in flight cannot draft (its last token is unknown), but with the
        ngram proposer its known tokens are looked up all the same: a match there sets
        ``draft_hot``, so the engine core plans the next step synchronously and it drafts."""
        spec = self.speculative_config
        assert spec is not None and self.proposer is not None
        if len(self.running) > spec.disable_by_batch_size or self.num_constrained_requests:
            return {}
        k = spec.num_speculative_tokens
        probe = spec.method == "ngram"  # a lookup costs no device work
        candidates: list[tuple[Request, DraftRequest]] = []
        for request in self.running:
            num_tokens = len(request.all_token_ids)
            in_flight = request.num_output_placeholders > 0  # its last token is unknown
            if (in_flight and not probe) or (
                    not in_flight and num_tokens - request.num_computed_tokens != 1):
                continue  # prefill left, or a step in flight
            # An accepted run never passes max_tokens, and positions stay below max_model_len.
            max_drafts = min(k, request.max_tokens - len(request.output_token_ids) - 1,
                             self.max_model_len - num_tokens)
            if max_drafts > 0 and self.draft_gate.may_draft(request):
                candidates.append((request, DraftRequest(request.request_id,
                                                         request.all_token_ids, max_drafts)))
            else:
                request.draft_hot = False
        if not candidates:
            return {}
        drafts = self.proposer.propose([c for _, c in candidates])
        out = {}
        for (request, _), draft in zip(candidates, drafts, strict=True):
            request.draft_hot = bool(draft)
            if draft and not request.num_output_placeholders:
                out[request.request_id] = draft
        return out

    def _schedule_running(self, plan: StepPlan, drafts: dict[str, list[int]] | None) -> None:
        running = RequestStatus.RUNNING
        allocate_slots = self.kv_cache_manager.allocate_slots
        for request in list(self.running):  # a copy: preemption removes from self.running
            if plan.token_budget == 0:
                break
            if request.status != running:
                continue  # preempted earlier in this step
            num_new_tokens = self._num_tokens_to_run(request, plan.token_budget)
            if num_new_tokens == 0:
                continue
            draft = drafts.get(request.request_id) if drafts else None
            if draft:
                draft = draft[: plan.token_budget - num_new_tokens]
                num_new_tokens += len(draft)
            new_blocks = allocate_slots(request, num_new_tokens)
            if new_blocks is None:
                new_blocks = self._preempt_until_fits(request, num_new_tokens, plan)
                if new_blocks is None:
                    continue  # it preempted itself (the least important); later ones may fit
            plan.add_running(request, num_new_tokens, new_blocks)
            if draft:
                plan.spec_token_ids[request.request_id] = draft

    def _num_tokens_to_run(self, request: Request, token_budget: int) -> int:
        # Lengths read from the lists directly: this runs for every running request each step.
        num_tokens = len(request.all_token_ids)
        num_computed = request.num_computed_tokens
        inflight = request.num_output_placeholders
        if inflight and (
            len(request.output_token_ids) + inflight >= request.max_tokens
            or num_tokens + inflight >= self.max_model_len
        ):
            return 0  # the steps in flight already take it to its length cap
        # Positions stay below max_model_len.
        num_left = min(num_tokens + inflight, self.max_model_len) - num_computed
        return max(0, min(num_left, token_budget))

    def _preempt_until_fits(
        self, request: Request, num_new_tokens: int, plan: StepPlan
    ) -> list[KVCacheBlock] | None:
        """Preempt running requests until ``request``'s allocation fits; None if ``request``
        itself was preempted."""
        while True:
            victim = self._pick_victim()
            plan.unschedule(victim)
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is request:
                return None
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_blocks is not None:
                return new_blocks

    def _pick_victim(self) -> Request:
        """Highest (priority, arrival) under ``priority``, latest arrival under ``fcfs``; ties
        go to the request later in the running list."""
        by_priority = self.scheduler_config.policy == "priority"

        def key(i: int) -> tuple:
            r = self.running[i]
            return ((r.priority,) if by_priority else ()) + (r.arrival_time, i)

        return self.running[max(range(len(self.running)), key=key)]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    def _schedule_waiting(self, plan: StepPlan) -> None:
        max_num_seqs = self.scheduler_config.max_num_seqs
        kv = self.kv_cache_manager
        admission = self.admission
        # Blocks held back for the running requests' future tokens (reserve admission): summed
        # at the first request that needs it, then kept up to date as requests join.
        reserved: int | None = None
        while self.waiting and plan.token_budget > 0 and len(self.running) < max_num_seqs:
            request = self.waiting.peek()
            if request.lora_request is not None and not self._adapter_fits(request):
                break  # head-of-line, like a failed allocation, until an adapter's requests end
            computed_blocks, num_cached_tokens = kv.get_computed_blocks(request)
            # With nothing running the head goes in whenever it fits: no reserve, no deadlock.
            if admission is not None and self.running:
                if reserved is None:
                    reserved = admission.reserved_blocks(self.running, kv)
                if not admission.admits(request, computed_blocks, reserved, kv):
                    break  # head-of-line, like a failed allocation
            num_new_tokens = request.num_tokens - num_cached_tokens
            if num_new_tokens > plan.token_budget:
                if not self.scheduler_config.enable_chunked_prefill:
                    break  # the whole prompt must fit in one step
                num_new_tokens = plan.token_budget
            new_blocks = kv.allocate_slots(
                request, num_new_tokens, num_cached_tokens, computed_blocks
            )
            if new_blocks is None:
                break  # head-of-line: later requests wait too, keeping the queue's order
            self.waiting.pop()
            self._admit(request, num_cached_tokens)
            plan.add_new(request, num_new_tokens)
            if reserved is not None:
                assert admission is not None
                reserved += admission.future_blocks(request, kv)

    def _adapter_fits(self, request: Request) -> bool:
        """Whether ``request``'s adapter is one the running requests use, or a slot is left
        for it (the runner holds ``max_loras`` adapters on the device)."""
        assert request.lora_request is not None
        in_use = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
        return request.lora_request.lora_int_id in in_use or len(in_use) < self.max_loras

    def _admit(self, request: Request, num_cached_tokens: int) -> None:
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached_tokens
        request.num_prompt_logprob_rows = 0  # its prompt runs from the start again
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached_tokens
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()

    def _advance(self, plan: StepPlan) -> None:
        num_scheduled_tokens = plan.num_scheduled_tokens
        track_placeholders = bool(self.scheduler_config.async_scheduling)
        for requests in (plan.running_reqs, plan.new_reqs):
            for request in requests:
                request.num_computed_tokens += num_scheduled_tokens[request.request_id]
                if track_placeholders and request.num_computed_tokens == (
                    len(request.all_token_ids) + request.num_output_placeholders
                ):
                    request.num_output_placeholders += 1  # this step samples its next token

    # ---- results -------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop checks, free finished requests' blocks.

        Returns one output per request that got tokens, finished, or has prompt logprobs.
        Requests finished or aborted since ``scheduler_output`` was planned are skipped.
        """
        outputs = []
        scheduled = scheduler_output.num_scheduled_tokens
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        requests = self.requests
        logprobs = runner_output.logprobs
        prompt_logprobs = runner_output.prompt_logprobs
        for rid, token_ids in zip(
            runner_output.req_ids, runner_output.sampled_token_ids, strict=True
        ):
            if rid not in scheduled:
                raise ValueError(f"runner_output: request {rid!r} was not scheduled in this step")
            request = requests.get(rid)
            if request is None:
                continue
            if spec_tokens and rid in spec_tokens:
                self._settle_drafts(request, len(spec_tokens[rid]), len(token_ids) - 1)
            # Empty token_ids: a prefill chunk that did not reach the end of the prompt.
            new_token_ids = self._append_tokens(request, token_ids) if token_ids else token_ids
            request_prompt_logprobs = prompt_logprobs.get(rid) if prompt_logprobs else None
            if request_prompt_logprobs is not None:
                request_prompt_logprobs = _unsent_prompt_rows(request, request_prompt_logprobs)
            request_logprobs = logprobs.get(rid) if logprobs else None
            if request_logprobs is not None and len(new_token_ids) < len(token_ids):
                request_logprobs = _first_rows(request_logprobs, len(new_token_ids))
            if new_token_ids or request_prompt_logprobs is not None:
                outputs.append(
                    self._make_engine_output(
                        request, new_token_ids, request_logprobs, request_prompt_logprobs
                    )
                )
        return outputs

    def _settle_drafts(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A verified step: the rejected drafts' positions were never computed."""
        request.num_computed_tokens -= num_drafts - num_accepted
        self.draft_gate.record(request, num_drafts, num_accepted)
        self.spec_stats.record(num_drafts, num_accepted)

    def _append_tokens(self, request: Request, token_ids: list[int]) -> list[int]:
        """Append the step's tokens (non-empty) up to the first that stops the request."""
        if request.num_output_placeholders > 0:
            request.num_output_placeholders -= 1
        appended, stopped = token_ids, False
        grammar = request.structured_output
        for i, token_id in enumerate(token_ids):
            # One token per step is the common case: append the runner's list as it is.
            request.append_output_token_ids(token_ids if len(token_ids) == 1 else [token_id])
            if len(request.output_token_ids) == 1:
                self.prompt_tokens += len(request.prompt_token_ids)
            if grammar is not None and not grammar.accept_token(token_id):
                logger.error("request %s: token %d is not allowed by its grammar; aborted",
                             request.request_id, token_id)
                request.status = RequestStatus.FINISHED_ABORTED
                appended, stopped = token_ids[: i + 1], True
                break
            if check_stop(request, self.max_model_len):
                appended, stopped = token_ids[: i + 1], True
                break
        self.generation_tokens += len(appended)
        # Blocks completed by tokens that were placeholders when they were scheduled.
        self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        if stopped:
            self._free_request(request)
        return appended

    def _make_engine_output(
        self,
        request: Request,
        new_token_ids: list[int],
        new_logprobs: LogprobsLists | None = None,
        new_prompt_logprobs: LogprobsLists | None = None,
    ) -> EngineCoreOutput:
        num_cached_tokens = request.num_cached_tokens  # -1 before the first scheduling
        # Positional, in EngineCoreOutput's field order: half the cost of keywords, and this
        # runs for every request every step.
        return EngineCoreOutput(
            request.request_id,
            new_token_ids,
            new_logprobs,
            new_prompt_logprobs,
            request.status.finish_reason,
            request.stop_reason,
            num_cached_tokens if num_cached_tokens > 0 else 0,
        )

    # ---- queries -------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._rejected)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def get_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.waiting_for_grammar),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            spec_decode_num_drafts=self.spec_stats.num_drafts,
            spec_decode_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_decode_accepted_per_position=tuple(self.spec_stats.accepted_per_position),
            max_loras=self.max_loras,
            running_lora_adapters=_adapter_names(self.running) if self.max_loras else (),
            waiting_lora_adapters=_adapter_names(self.waiting) if self.max_loras else (),
        )


def _adapter_names(requests: Iterable[Request]) -> tuple[str, ...]:
    return tuple(sorted({r.lora_request.lora_name for r in requests if r.lora_request}))


def _first_rows(logprobs: LogprobsLists, num_rows: int) -> LogprobsLists:
    """The logprobs of the first ``num_rows`` tokens (a run cut short by a stop)."""
    return LogprobsLists(logprobs.token_ids[:num_rows], logprobs.logprobs[:num_rows],
                         logprobs.ranks[:num_rows])


def _unsent_prompt_rows(request: Request, rows: LogprobsLists) -> LogprobsLists | None:
    """The step's prompt-logprob rows less those sent before a preemption; None if none is
    left."""
    skip = request.take_prompt_logprob_rows(len(rows.ranks))
    if skip == 0:
        return rows
    if skip == len(rows.ranks):
        return None
    return LogprobsLists(rows.token_ids[skip:], rows.logprobs[skip:], rows.ranks[skip:])


def _check_limits(
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    max_model_len: int,
    num_blocks: int,
) -> None:
    """Refuse limits under which a request could never finish (it would wait forever)."""
    block_size = cache_config.block_size
    needed = -(-max_model_len // block_size) + 1  # + the null block
    if num_blocks < needed:
        raise ValueError(
            f"num_blocks: {num_blocks} blocks of {block_size} tokens (one is the null block) "
            f"cannot hold one request of max_model_len={max_model_len} tokens; need {needed} "
            "(lower max_model_len, or give the KV cache more memory: kv_cache_memory on the "
            "CPU, gpu_memory_utilization on a GPU)"
        )
    budget = scheduler_config.max_num_batched_tokens
    if not scheduler_config.enable_chunked_prefill and budget < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens: {budget} is below max_model_len={max_model_len}; without "
            "chunked prefill a whole prompt must fit in one step"
        )
