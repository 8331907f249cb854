"""Test helpers for core/: request and scheduler builders, a fake model runner that checks the
plans it receives, and the invariants every scheduler state must satisfy."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.core.scheduler import Scheduler
from pagedserve.sampling_params import SamplingParams

EOS = 0
VOCAB = 11


def make_request(
    rid: str,
    prompt: list[int],
    max_tokens: int = 16,
    priority: int = 0,
    arrival_time: float | None = None,
    cache_salt: str | None = None,
    **sampling: Any,
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, **sampling)
    arrival = float(int(rid)) if arrival_time is None and rid.isdigit() else arrival_time
    return Request(rid, prompt, params, EOS, max_tokens, arrival_time=arrival, priority=priority,
                   cache_salt=cache_salt)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 64,
    enable_prefix_caching: bool = True,
    **scheduler_kwargs: Any,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(**scheduler_kwargs),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        max_model_len=max_model_len,
        num_blocks=num_blocks,
    )


def fake_token(history: list[int]) -> int:
    """The fake model: the next token is a fixed function of the whole history, so a request
    resumed with a wrong history (or attending to wrong KV) produces different tokens."""
    return (sum(history) * 7 + len(history) * 3 + history[-1]) % VOCAB


def reference_output(request: Request, max_model_len: int) -> tuple[list[int], str]:
    """Oracle: the tokens and finish reason of ``request`` generated alone, without paging."""
    params = request.sampling_params
    history, out = list(request.prompt_token_ids), []
    while True:
        token = fake_token(history)
        history.append(token)
        out.append(token)
        if len(history) >= max_model_len or len(out) >= request.max_tokens:
            return out, "length"
        if len(out) >= params.min_tokens and (
            (not params.ignore_eos and token == EOS) or token in params.stop_token_ids
        ):
            return out, "stop"


@dataclass
class _Slot:
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    fingerprints: list[int] = field(default_factory=list)
    """fingerprints[p] identifies token_ids[: p + 1] (what the KV at position p depends on)."""

    def fingerprint(self, pos: int) -> int:
        while len(self.fingerprints) <= pos:
            p = len(self.fingerprints)
            parent = self.fingerprints[-1] if p else 0
            self.fingerprints.append(hash((parent, self.token_ids[p])))
        return self.fingerprints[pos]


class FakeRunner:
    """Mirrors plans into per-request slots like the model runner, and "computes" KV: the KV of
    position p is the fingerprint of the tokens up to p, written into its cache slot
    (block_id * block_size + offset). Every attention read is checked against the request's
    own history, so wrong prefix hits, blocks reused while shared, or a wrong resumed history
    fail loudly. Writes of a step land before its reads, like a layer's KV write before its
    attention."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[str, _Slot] = {}
        self.kv: dict[int, int] = {}  # cache slot -> fingerprint

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        self._apply(plan)
        scheduled = list(plan.num_scheduled_tokens.items())
        for rid, n in scheduled:
            slot = self.slots[rid]
            start, end = slot.num_computed_tokens, slot.num_computed_tokens + n
            assert end <= len(slot.token_ids), f"{rid}: runs tokens it does not know"
            assert len(slot.block_ids) * self.block_size >= end, f"{rid}: too few blocks"
            for pos in range(start, end):
                self.kv[self._cache_slot(slot, pos)] = slot.fingerprint(pos)
        sampled = []
        for rid, n in scheduled:
            slot = self.slots[rid]
            slot.num_computed_tokens += n
            for pos in range(slot.num_computed_tokens):
                got = self.kv.get(self._cache_slot(slot, pos))
                assert got == slot.fingerprint(pos), f"{rid}: wrong KV at position {pos}"
            if slot.num_computed_tokens == len(slot.token_ids):
                slot.token_ids.append(fake_token(slot.token_ids))
                sampled.append([slot.token_ids[-1]])
            else:
                sampled.append([])
        return ModelRunnerOutput([rid for rid, _ in scheduled], sampled)

    def _apply(self, plan: SchedulerOutput) -> None:
        for rid in plan.finished_req_ids | plan.preempted_req_ids:
            self.slots.pop(rid, None)
        for new in plan.scheduled_new_reqs:
            assert new.req_id not in self.slots, f"{new.req_id}: new request already has a slot"
            assert new.num_computed_tokens % self.block_size == 0
            assert new.num_prompt_tokens + new.num_output_tokens == len(new.prefill_token_ids)
            self.slots[new.req_id] = _Slot(
                list(new.prefill_token_ids), new.num_computed_tokens, list(new.block_ids[0])
            )
        cached = plan.scheduled_cached_reqs
        for rid, new_block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            slot = self.slots[rid]
            assert slot.num_computed_tokens == num_computed, f"{rid}: computed-token mismatch"
            if new_block_ids is not None:
                assert new_block_ids[0], "new_block_ids must be None when no block was added"
                slot.block_ids.extend(new_block_ids[0])

    def _cache_slot(self, slot: _Slot, pos: int) -> int:
        block_id = slot.block_ids[pos // self.block_size]
        assert block_id != 0, "the null block is never written"
        return block_id * self.block_size + pos % self.block_size


def check_plan(plan: SchedulerOutput, config: SchedulerConfig) -> None:
    counts = plan.num_scheduled_tokens
    assert all(n > 0 for n in counts.values())
    assert plan.total_num_scheduled_tokens == sum(counts.values())
    assert plan.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(counts) <= config.max_num_seqs
    ids = [r.req_id for r in plan.scheduled_new_reqs] + plan.scheduled_cached_reqs.req_ids
    assert sorted(ids) == sorted(counts)
    assert not plan.preempted_req_ids & set(counts)


def check_kv_invariants(kv: KVCacheManager) -> None:
    """Reference counts equal holders; the free queue holds exactly the unreferenced blocks;
    the hash map and the blocks' hashes agree."""
    pool = kv.block_pool
    holders: Counter[int] = Counter()
    for blocks in kv.req_to_blocks.values():
        ids = [b.block_id for b in blocks]
        assert len(ids) == len(set(ids)), "a request holds a block twice"
        holders.update(ids)
    assert 0 not in holders, "the null block was handed out"
    free_ids = [b.block_id for b in pool.free_block_queue]
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders[block.block_id], f"block {block.block_id}"
        assert (block.ref_cnt == 0) == (block.block_id in set(free_ids))
        if block.block_hash is not None:
            assert pool.get_cached_block(block.block_hash) is not None
    assert pool.num_cached_blocks() == sum(b.block_hash is not None for b in pool.blocks)


def check_scheduler_invariants(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    check_kv_invariants(kv)
    assert len(sched.running) <= sched.scheduler_config.max_num_seqs
    assert set(kv.req_to_blocks) == {r.request_id for r in sched.running}
    assert len(sched.running) + len(sched.waiting) == len(sched.requests)
    for r in sched.running:
        assert len(kv.req_to_blocks[r.request_id]) * kv.block_size >= r.num_computed_tokens


class EngineLoop:
    """schedule -> fake execute -> update_from_output, like EngineCore; under async scheduling
    one step stays in flight (step N+1 is planned before step N's tokens are appended)."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.runner = FakeRunner(sched.kv_cache_manager.block_size)
        self.depth = 1 if sched.scheduler_config.async_scheduling else 0
        self.pending: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
        self.tokens: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}
        self.plans: list[SchedulerOutput] = []

    def step(self) -> SchedulerOutput:
        plan = self.sched.schedule()
        check_plan(plan, self.sched.scheduler_config)
        self.plans.append(plan)
        self.pending.append((plan, self.runner.execute(plan)))
        while len(self.pending) > self.depth:
            self._update(*self.pending.pop(0))
        return plan

    def flush(self) -> None:
        while self.pending:
            self._update(*self.pending.pop(0))

    def abort(self, request_ids: list[str]) -> None:
        for out in self.sched.abort_requests(request_ids):
            self._record(out.req_id, out.new_token_ids, out.finish_reason)

    def run_until_done(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
        self.flush()
        assert not self.sched.has_unfinished_requests(), "requests left unfinished"

    def _update(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> None:
        for out in self.sched.update_from_output(plan, result):
            self._record(out.req_id, out.new_token_ids, out.finish_reason)

    def _record(self, rid: str, token_ids: list[int], finish_reason: str | None) -> None:
        assert rid not in self.finish_reasons, f"{rid}: output after it finished"
        self.tokens.setdefault(rid, []).extend(token_ids)
        if finish_reason is not None:
            self.finish_reasons[rid] = finish_reason
