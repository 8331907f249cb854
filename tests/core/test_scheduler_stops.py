"""Stop checks applied by Scheduler.update_from_output, and finishing from outside."""

from __future__ import annotations

import pytest

from pagedserve.core.request import RequestStatus
from pagedserve.core.sched_output import LogprobsLists, ModelRunnerOutput
from pagedserve.core.scheduler import Scheduler
from tests.core.core_helpers import EOS, make_request, make_scheduler

PROMPT = [5, 6, 7]


def feed(sched: Scheduler, rid: str, token: int, **runner_extra):
    """One step in which ``rid`` samples ``token``; returns its outputs."""
    plan = sched.schedule()
    assert rid in plan.num_scheduled_tokens
    return sched.update_from_output(plan, ModelRunnerOutput([rid], [[token]], **runner_extra))


def run(tokens: list[int], max_model_len: int = 64, **params) -> tuple[list[int], str, object]:
    """Feed ``tokens`` until the request finishes; return (generated, finish_reason, stop_reason)."""
    sched = make_scheduler(max_model_len=max_model_len)
    sched.add_request(make_request("0", PROMPT, **params))
    generated = []
    for token in tokens:
        (out,) = feed(sched, "0", token)
        generated += out.new_token_ids
        if out.finished:
            assert not sched.has_unfinished_requests()
            assert sched.kv_cache_manager.usage == 0.0
            return generated, out.finish_reason, out.stop_reason
    return generated, "running", None


@pytest.mark.parametrize(
    "tokens, params, expected",
    [
        ([1, EOS, 2], {}, ([1, EOS], "stop", None)),
        ([1, EOS, 2], {"ignore_eos": True}, ([1, EOS, 2], "running", None)),
        ([EOS, 1, EOS], {"min_tokens": 2}, ([EOS, 1, EOS], "stop", None)),
        ([EOS, EOS], {"min_tokens": 2}, ([EOS, EOS], "stop", None)),
        ([1, 9, 2], {"stop_token_ids": [9]}, ([1, 9], "stop", 9)),
        ([9, 9], {"stop_token_ids": [9], "min_tokens": 2}, ([9, 9], "stop", 9)),
        ([1, 2, EOS], {"max_tokens": 3}, ([1, 2, EOS], "length", None)),
        ([1, 2, 3, 4], {"max_tokens": 3}, ([1, 2, 3], "length", None)),
    ],
)
def test_stop_conditions(tokens, params, expected):
    assert run(tokens, **params) == expected


def test_max_model_len_caps_the_output():
    assert run([1, 2, 3, 4], max_model_len=5, max_tokens=10) == ([1, 2], "length", None)


def test_finish_requests_for_stop_strings_and_unknown_ids():
    sched = make_scheduler()
    sched.add_request(make_request("0", PROMPT))
    sched.add_request(make_request("1", PROMPT))
    feed(sched, "0", 1)
    outs = sched.finish_requests(["0", "nope"], RequestStatus.FINISHED_STOPPED)
    assert [(o.req_id, o.finish_reason, o.new_token_ids) for o in outs] == [("0", "stop", [])]
    assert sched.finish_requests(["0"], RequestStatus.FINISHED_STOPPED) == []
    assert sched.requests.keys() == {"1"}
    assert sched.schedule().finished_req_ids == {"0"}


def test_logprobs_are_passed_through_and_prompt_logprobs_reported_for_chunks():
    sched = make_scheduler(max_num_batched_tokens=2)
    sched.add_request(make_request("0", PROMPT, max_tokens=1))
    plan = sched.schedule()  # 2 of 3 prompt tokens: nothing sampled
    prompt_lp = LogprobsLists([[6]], [[-0.5]], [1])
    (out,) = sched.update_from_output(
        plan, ModelRunnerOutput(["0"], [[]], prompt_logprobs={"0": prompt_lp})
    )
    assert out.new_token_ids == [] and out.new_prompt_logprobs is prompt_lp and not out.finished
    sample_lp = LogprobsLists([[4]], [[-0.1]], [1])
    (out,) = feed(sched, "0", 4, logprobs={"0": sample_lp})
    assert out.new_logprobs is sample_lp and out.finish_reason == "length"
    plan = sched.schedule()
    assert sched.update_from_output(plan, ModelRunnerOutput([], [])) == []


def test_prompt_logprobs_recomputed_after_a_preemption_are_not_sent_twice():
    sched = make_scheduler(max_num_batched_tokens=2)
    sched.add_request(make_request("0", [5, 6, 7, 8, 9], max_tokens=1, prompt_logprobs=0))

    def chunk(rows: list[int]) -> LogprobsLists | None:
        """One step of 2 prompt tokens with one logprob row per predicted token."""
        plan = sched.schedule()
        assert plan.num_scheduled_tokens == {"0": 2}
        lp = LogprobsLists([[t] for t in rows], [[-1.0]] * len(rows), [1] * len(rows))
        outs = sched.update_from_output(plan, ModelRunnerOutput(["0"], [[]],
                                                                prompt_logprobs={"0": lp}))
        return outs[0].new_prompt_logprobs if outs else None

    first = chunk([6, 7])  # positions 0-1 predict tokens 6 and 7
    assert first is not None and first.token_ids == [[6], [7]]
    request = sched.requests["0"]
    sched._preempt(request)
    assert chunk([6, 7]) is None  # recomputed from the start: sent already
    second = chunk([8, 9])
    assert second is not None and second.token_ids == [[8], [9]]
    assert request.num_prompt_logprob_rows_sent == 4
