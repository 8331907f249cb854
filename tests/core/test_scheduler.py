"""Scheduler: chunked prefill, decodes before prefills, limits, preemption and resumption,
aborts, prefix hits, async scheduling. Uses the fake runner of core_helpers."""

from __future__ import annotations

import pytest

from pagedserve.core.request import RequestStatus
from pagedserve.core.sched_output import ModelRunnerOutput
from tests.core.core_helpers import (
    EngineLoop,
    check_scheduler_invariants,
    make_request,
    make_scheduler,
    reference_output,
)


def test_chunked_prefill_of_prompt_longer_than_budget():
    sched = make_scheduler(max_num_batched_tokens=8)
    loop = EngineLoop(sched)
    sched.add_request(make_request("0", list(range(1, 21)), max_tokens=3, ignore_eos=True))

    p1 = loop.step()
    (new,) = p1.scheduled_new_reqs
    assert (new.num_computed_tokens, new.block_ids) == (0, ([1, 2],))
    assert p1.num_scheduled_tokens == {"0": 8} and loop.tokens == {}

    p2 = loop.step()
    assert p2.scheduled_cached_reqs.num_computed_tokens == [8]
    assert p2.scheduled_cached_reqs.new_block_ids == [([3, 4],)]
    assert p2.num_scheduled_tokens == {"0": 8}

    p3 = loop.step()  # the last 4 prompt tokens, then the first sampled token
    assert p3.num_scheduled_tokens == {"0": 4}
    assert p3.scheduled_cached_reqs.new_block_ids == [([5],)]
    assert len(loop.tokens["0"]) == 1

    p4 = loop.step()  # decode of position 20 opens block 6
    assert p4.num_scheduled_tokens == {"0": 1}
    assert p4.scheduled_cached_reqs.new_block_ids == [([6],)]
    p5 = loop.step()  # position 21 fits in block 6: no new block
    assert p5.scheduled_cached_reqs.new_block_ids == [None]
    assert loop.finish_reasons == {"0": "length"} and len(loop.tokens["0"]) == 3
    assert sched.kv_cache_manager.usage == 0.0


def test_decodes_are_scheduled_before_prefills():
    sched = make_scheduler(max_num_batched_tokens=8)
    loop = EngineLoop(sched)
    sched.add_request(make_request("0", [1, 2, 3, 4], ignore_eos=True))
    loop.step()
    sched.add_request(make_request("1", list(range(1, 13)), ignore_eos=True))
    plan = loop.step()
    assert list(plan.num_scheduled_tokens.items()) == [("0", 1), ("1", 7)]
    assert plan.scheduled_cached_reqs.req_ids == ["0"]
    assert [r.req_id for r in plan.scheduled_new_reqs] == ["1"]


def test_max_num_seqs_is_respected():
    sched = make_scheduler(max_num_seqs=2)
    loop = EngineLoop(sched)
    for i in range(3):
        sched.add_request(make_request(str(i), [i + 1] * 5, max_tokens=4, ignore_eos=True))
    plan = loop.step()
    assert sorted(plan.num_scheduled_tokens) == ["0", "1"]
    assert [r.request_id for r in sched.waiting] == ["2"]
    loop.run_until_done()
    assert all(len(p.num_scheduled_tokens) <= 2 for p in loop.plans)
    assert loop.finish_reasons == {"0": "length", "1": "length", "2": "length"}


@pytest.mark.parametrize("chunked, expected", [(False, {"0": 10}), (True, {"0": 10, "1": 6})])
def test_prompt_that_does_not_fit_waits_without_chunked_prefill(chunked, expected):
    sched = make_scheduler(
        max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=chunked
    )
    loop = EngineLoop(sched)
    sched.add_request(make_request("0", [1] * 10, ignore_eos=True))
    sched.add_request(make_request("1", [2] * 10, ignore_eos=True))
    assert loop.step().num_scheduled_tokens == expected
    if not chunked:
        assert loop.step().num_scheduled_tokens == {"0": 1, "1": 10}


def test_preemption_when_blocks_run_out_and_resumption_with_same_history():
    # 4 usable blocks of 4 tokens: two requests of 6 prompt tokens fill them at 8 tokens each.
    # Greedy admission: the reserve policy would hold the second back (it avoids preemption).
    sched = make_scheduler(num_blocks=5, max_model_len=16, admission_policy="greedy")
    loop = EngineLoop(sched)
    reqs = [make_request(str(i), [3 + i] * 6, max_tokens=8, ignore_eos=True) for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    while not loop.plans or not loop.plans[-1].preempted_req_ids:
        loop.step()
    plan = loop.plans[-1]
    assert plan.preempted_req_ids == {"1"}  # the latest arrival
    assert plan.num_scheduled_tokens == {"0": 1}
    victim = reqs[1]
    assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert sched.waiting.peek() is victim and sched.get_stats().num_preemptions == 1
    generated = list(victim.output_token_ids)
    assert generated and sched.kv_cache_manager.get_block_ids("1") == ([],)
    check_scheduler_invariants(sched)

    while not any(r.req_id == "1" for r in loop.plans[-1].scheduled_new_reqs):
        loop.step()
    (resumed,) = loop.plans[-1].scheduled_new_reqs
    assert resumed.prefill_token_ids == [4] * 6 + generated
    assert resumed.num_output_tokens == len(generated)

    loop.run_until_done()
    for r in reqs:
        assert (loop.tokens[r.request_id], loop.finish_reasons[r.request_id]) == (
            reference_output(r, sched.max_model_len)
        )
    assert sched.kv_cache_manager.usage == 0.0


def test_priority_policy_preempts_lowest_priority_even_itself():
    sched = make_scheduler(num_blocks=5, max_model_len=16, policy="priority",
                           admission_policy="greedy")
    loop = EngineLoop(sched)
    low = make_request("0", [3] * 6, max_tokens=8, priority=1, ignore_eos=True)
    high = make_request("1", [4] * 6, max_tokens=8, priority=0, ignore_eos=True)
    sched.add_request(low)
    loop.step()  # "0" runs alone first, so it comes first in the running list
    sched.add_request(high)
    loop.step()
    while not loop.plans[-1].preempted_req_ids:
        assert [r.request_id for r in sched.running] == ["0", "1"]
        loop.step()
    plan = loop.plans[-1]
    # "0" ran first in the running list, needed a block, and was the lowest priority itself:
    # it is preempted and not scheduled; "1" still runs in the same step.
    assert plan.preempted_req_ids == {"0"} and plan.num_scheduled_tokens == {"1": 1}
    loop.run_until_done()
    for r in (low, high):
        assert loop.tokens[r.request_id] == reference_output(r, 16)[0]


def test_priority_policy_admits_by_priority():
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    loop = EngineLoop(sched)
    sched.add_request(make_request("0", [1, 2], max_tokens=1, priority=5))
    sched.add_request(make_request("1", [1, 2], max_tokens=1, priority=0))
    assert list(loop.step().num_scheduled_tokens) == ["1"]
    assert list(loop.step().num_scheduled_tokens) == ["0"]


def test_preempting_a_request_already_scheduled_in_the_step_undoes_it():
    # fcfs, but "b" arrived last while it is first in the running list.
    sched = make_scheduler(num_blocks=5, max_model_len=16, admission_policy="greedy")
    loop = EngineLoop(sched)
    b = make_request("b", [5] * 7, max_tokens=6, arrival_time=5.0, ignore_eos=True)
    a = make_request("a", [6] * 8, max_tokens=6, arrival_time=1.0, ignore_eos=True)
    sched.add_request(b)
    sched.add_request(a)
    loop.step()  # both prefilled: all 4 blocks in use
    assert [r.request_id for r in sched.running] == ["b", "a"]
    plan = loop.step()  # b's decode fits, a's needs a block: b (latest arrival) is undone
    assert plan.preempted_req_ids == {"b"}
    assert plan.num_scheduled_tokens == {"a": 1} and plan.total_num_scheduled_tokens == 1
    assert plan.scheduled_cached_reqs.req_ids == ["a"]
    check_scheduler_invariants(sched)
    loop.run_until_done()
    for r in (a, b):
        assert loop.tokens[r.request_id] == reference_output(r, 16)[0]


def test_abort_frees_everything():
    sched = make_scheduler(max_num_seqs=2)
    loop = EngineLoop(sched)
    for i in range(3):
        sched.add_request(make_request(str(i), [i + 1] * 9, ignore_eos=True))
    loop.step()
    loop.step()
    assert sched.kv_cache_manager.usage > 0
    loop.abort(["0", "2", "unknown"])  # one running, one waiting, one unknown
    assert loop.finish_reasons == {"0": "abort", "2": "abort"}
    assert sched.get_num_unfinished_requests() == 1

    plan = sched.schedule()  # "1" runs; an abort lands before its output comes back
    result = loop.runner.execute(plan)
    assert sched.abort_requests(["1", "1"])[0].finish_reason == "abort"
    assert sched.update_from_output(plan, result) == []
    assert sched.kv_cache_manager.usage == 0.0
    assert not sched.has_unfinished_requests() and sched.finished_req_ids == {"1"}
    assert sched.schedule().finished_req_ids == {"1"}
    assert plan.finished_req_ids == {"0", "2"}


def test_prefix_hit_between_requests_sharing_a_prompt_prefix():
    sched = make_scheduler()
    loop = EngineLoop(sched)
    shared = list(range(1, 9))  # two full blocks
    sched.add_request(make_request("0", shared + [20, 21], max_tokens=3, ignore_eos=True))
    loop.step()
    sched.add_request(make_request("1", shared + [30], max_tokens=2, ignore_eos=True))
    plan = loop.step()
    (new,) = plan.scheduled_new_reqs
    assert new.num_computed_tokens == 8 and plan.num_scheduled_tokens["1"] == 1
    assert new.block_ids[0][:2] == sched.kv_cache_manager.get_block_ids("0")[0][:2]
    loop.run_until_done()
    stats = sched.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10 + 9, 8)
    assert (stats.prompt_tokens, stats.generation_tokens) == (19, 5)
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)


def test_async_scheduling_plans_ahead_and_matches_sync():
    results = {}
    for async_scheduling in (False, True):
        sched = make_scheduler(num_blocks=9, max_model_len=32, async_scheduling=async_scheduling)
        loop = EngineLoop(sched)
        reqs = [make_request(str(i), [i + 2] * (3 + 4 * i), max_tokens=7) for i in range(3)]
        for r in reqs:
            sched.add_request(r)
        loop.run_until_done()
        results[async_scheduling] = (loop.tokens, loop.finish_reasons)
        for r in reqs:
            assert (loop.tokens[r.request_id], loop.finish_reasons[r.request_id]) == (
                reference_output(r, 32)
            )
        assert sched.kv_cache_manager.usage == 0.0
    assert results[False] == results[True]

    sched = make_scheduler(async_scheduling=True)
    sched.add_request(make_request("0", [1, 2, 3], max_tokens=5, ignore_eos=True))
    first, second = sched.schedule(), sched.schedule()  # no output in between
    assert first.num_scheduled_tokens == {"0": 3} and second.num_scheduled_tokens == {"0": 1}
    assert sched.requests["0"].num_output_placeholders == 2
    sched.update_from_output(first, ModelRunnerOutput(["0"], [[7]]))
    assert sched.requests["0"].num_output_placeholders == 1


def test_runner_output_for_unscheduled_request_is_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("0", [1, 2]))
    plan = sched.schedule()
    with pytest.raises(ValueError, match="'x' was not scheduled"):
        sched.update_from_output(plan, ModelRunnerOutput(["x"], [[1]]))


def test_bad_requests_and_limits_are_refused():
    sched = make_scheduler(max_model_len=8)
    sched.add_request(make_request("0", [1]))
    with pytest.raises(ValueError, match="already in the scheduler"):
        sched.add_request(make_request("0", [1]))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        sched.add_request(make_request("1", []))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        sched.add_request(make_request("2", [1] * 9))
    with pytest.raises(ValueError, match="num_blocks"):
        make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_scheduler(max_model_len=64, max_num_batched_tokens=32, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="status"):
        sched.finish_requests(["0"], RequestStatus.RUNNING)
