"""Reserve admission (core/admission.py): exact hold-back and admission, the ratio's decay and
its resets, no deadlock, no block leak, and the tokens reserved in full."""

from __future__ import annotations

from typing import Any

import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.core.admission import RatioAdmission, ReserveAdmission
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.core.scheduler import Scheduler
from tests.core.core_helpers import (
    EngineLoop,
    check_scheduler_invariants,
    make_request,
    make_scheduler,
    reference_output,
)

TOKEN = 5
"""What ``step`` samples: never EOS (0), so requests without ``ignore_eos`` run on too."""


def step(sched: Scheduler) -> SchedulerOutput:
    """One synchronous step; every request that reaches the end of its tokens samples TOKEN."""
    plan = sched.schedule()
    ids = list(plan.num_scheduled_tokens)
    sampled = [
        [TOKEN] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else []
        for r in ids
    ]
    sched.update_from_output(plan, ModelRunnerOutput(ids, sampled))
    check_scheduler_invariants(sched)
    return plan


def new_ids(plan: SchedulerOutput) -> list[str]:
    return [r.req_id for r in plan.scheduled_new_reqs]


@pytest.mark.parametrize("policy", ["reserve", "greedy"])
def test_held_back_while_the_reserve_does_not_fit_admitted_once_it_does(policy):
    # 12 usable blocks of 4 tokens; the ratio falls 1.0, 0.75, 0.5, ... one step at a time.
    sched = make_scheduler(
        num_blocks=13,
        max_model_len=32,
        admission_policy=policy,
        admission_ratio_init=1.0,
        admission_ratio_min=0.0,
        admission_ratio_decay_steps=4,
    )
    sched.add_request(make_request("0", [1] * 8, max_tokens=16))
    assert new_ids(step(sched)) == ["0"]  # nothing running: admitted, 2 blocks
    sched.add_request(make_request("1", [2] * 16, max_tokens=12))
    plan = step(sched)
    if policy == "greedy":
        assert new_ids(plan) == ["1"]  # its 4 prompt blocks are free
        return
    # Ratio 0.75. "0" (9 tokens, 3 blocks, 15 to go) reserves ceil(11.25) = 12 tokens: 21
    # tokens, 6 blocks, 3 more. Free 9 - 3 = 6 < "1"'s 16 + ceil(9) = 25 tokens = 7 blocks.
    assert new_ids(plan) == [] and sched.admission is not None
    assert sched.admission.ratio == 0.5
    # Ratio 0.5. "0" (10 tokens, 14 to go): 17 tokens, 5 blocks, 2 more; 9 - 2 = 7 free is
    # enough for "1": 16 + 6 = 22 tokens, 6 blocks.
    assert new_ids(step(sched)) == ["1"]


def test_ratio_decays_to_its_minimum_and_resets_on_a_preemption():
    # 4 usable blocks of 4 tokens. The ratio reaches 0 after one step, so "1" is admitted as
    # greedily as vLLM would, and both outgrow the cache.
    sched = make_scheduler(
        num_blocks=5,
        max_model_len=16,
        admission_ratio_init=1.0,
        admission_ratio_min=0.0,
        admission_ratio_decay_steps=1,
    )
    admission = sched.admission
    assert admission is not None and admission.ratio == 1.0
    sched.add_request(make_request("0", [1] * 6, max_tokens=8))
    step(sched)
    assert admission.ratio == 0.0
    sched.add_request(make_request("1", [2] * 6, max_tokens=8))
    assert new_ids(step(sched)) == ["1"]
    step(sched)
    plan = step(sched)  # "0" needs its third block: "1" (the latest arrival) is preempted
    assert plan.preempted_req_ids == {"1"} and admission.ratio == 1.0
    # Ratio 1.0: "0" (10 tokens, 4 to go) reserves all 4 blocks; "1" waits.
    assert new_ids(step(sched)) == [] and admission.ratio == 0.0
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.kv_cache_manager.usage == 0.0


def test_ratio_is_linear_from_init_to_min_and_a_burst_after_a_pause_starts_at_init():
    config = SchedulerConfig(
        admission_ratio_init=0.7, admission_ratio_min=0.1, admission_ratio_decay_steps=3
    )
    admission = ReserveAdmission(config, max_model_len=64)
    ratios = []
    for _ in range(5):
        ratios.append(admission.ratio)
        admission.decay()
    assert ratios == pytest.approx([0.7, 0.5, 0.3, 0.1, 0.1])

    sched = make_scheduler(
        admission_ratio_init=0.7, admission_ratio_min=0.1, admission_ratio_decay_steps=3
    )
    sched.add_request(make_request("0", [1] * 3, max_tokens=4))
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.admission is not None and sched.admission.ratio == pytest.approx(0.1)
    sched.add_request(make_request("1", [1] * 3, max_tokens=4))
    assert sched.admission.ratio == pytest.approx(0.7)


def run_serial_workload(policy: str) -> tuple[int, int, EngineLoop]:
    """Three requests that each fill the whole cache at full length (ignore_eos)."""
    sched = make_scheduler(num_blocks=5, max_model_len=16, admission_policy=policy)
    loop = EngineLoop(sched)
    for i in range(3):
        sched.add_request(make_request(str(i), [i + 1] * 4, max_tokens=12, ignore_eos=True))
    peak = 0
    while sched.has_unfinished_requests():
        loop.step()
        peak = max(peak, len(sched.running))
    loop.flush()
    assert sched.kv_cache_manager.usage == 0.0  # no block leaks
    check_scheduler_invariants(sched)
    return sched.num_preemptions, peak, loop


def test_no_deadlock_and_no_preemption_when_each_request_needs_the_whole_cache():
    preemptions, peak, loop = run_serial_workload("reserve")
    # Each is admitted alone, when the one before finished; none is ever preempted.
    assert (preemptions, peak) == (0, 1)
    for r in range(3):
        request = make_request(str(r), [r + 1] * 4, max_tokens=12, ignore_eos=True)
        assert loop.tokens[str(r)] == reference_output(request, 16)[0]
    greedy_preemptions, greedy_peak, _ = run_serial_workload("greedy")
    assert greedy_preemptions > 0 and greedy_peak == 3


def test_tokens_a_request_is_certain_to_generate_are_reserved_in_full():
    kv = KVCacheManager(num_blocks=20, block_size=4, max_model_len=32)
    config = SchedulerConfig(admission_ratio_init=0.5, admission_ratio_min=0.5)
    admission = ReserveAdmission(config, max_model_len=32)
    prompt = [1] * 8

    def future(max_tokens: int = 20, **sampling: Any) -> int:
        return admission.future_blocks(make_request("x", prompt, max_tokens, **sampling), kv)

    # min_tokens 6 certain, ceil(0.5 * 14) = 7 of the rest: 8 + 13 = 21 tokens, 6 blocks.
    assert future(min_tokens=6) == 6
    assert future(ignore_eos=True) == 7  # all 20: 28 tokens
    assert future(max_tokens=40, ignore_eos=True) == 8  # capped at max_model_len
    assert future(ignore_eos=True, stop_token_ids=[3]) == 5  # may stop: 8 + 10 tokens
    assert future(ignore_eos=True, stop=["x"]) == 5
    request = make_request("r", prompt, max_tokens=20, min_tokens=6)
    assert kv.allocate_slots(request, 8) is not None  # holds 2 of its 6 blocks
    assert admission.future_blocks(request, kv) == 4
    # The ratio policy guesses for ignore_eos requests too: 8 + 10 tokens.
    ratio_only = RatioAdmission(config, max_model_len=32)
    assert ratio_only.future_blocks(make_request("y", prompt, 20, ignore_eos=True), kv) == 5


def test_random_streams_finish_without_leaks_under_every_policy():
    """Many requests of mixed lengths on a small pool, EOS possible: every request finishes
    with the unpaged reference's tokens and every block comes back."""
    for policy in ("reserve", "ratio", "greedy"):
        sched = make_scheduler(
            num_blocks=12,
            max_model_len=24,
            max_num_seqs=6,
            max_num_batched_tokens=10,
            admission_policy=policy,
        )
        loop = EngineLoop(sched)
        requests = [
            make_request(
                str(i),
                [(i * 5 + j) % 11 for j in range(2 + i % 7)],
                max_tokens=3 + (i * 7) % 14,
                ignore_eos=i % 3 == 0,
            )
            for i in range(20)
        ]
        for request in requests:
            sched.add_request(request)
        loop.run_until_done()
        for r in requests:
            expected = reference_output(r, 24)
            assert (loop.tokens[r.request_id], loop.finish_reasons[r.request_id]) == expected
        assert sched.kv_cache_manager.usage == 0.0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"admission_policy": "lazy"}, "admission_policy"),
        ({"admission_ratio_init": 0.2, "admission_ratio_min": 0.5}, "admission_ratio_init"),
        ({"admission_ratio_init": 1.5}, "admission_ratio_init"),
        ({"admission_ratio_min": -0.1}, "admission_ratio_min"),
        ({"admission_ratio_decay_steps": 0}, "admission_ratio_decay_steps"),
    ],
)
def test_bad_admission_settings_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)
