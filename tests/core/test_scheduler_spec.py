"""Speculative decoding in the scheduler: drafts scheduled after the last token, rejected
drafts taken back off num_computed_tokens, stops and max_tokens inside an accepted run, and
random streams (preemption, chunked prefill, prefix caching, async scheduling) that end with
the unpaged reference's tokens."""

from __future__ import annotations

from hypothesis import event, given, settings

from pagedserve.config import SpeculativeConfig
from pagedserve.core.sched_output import LogprobsLists, ModelRunnerOutput
from pagedserve.spec_decode.proposer import StatelessProposer
from tests.core.core_helpers import check_scheduler_invariants, make_request, make_scheduler
from tests.core.spec_helpers import OracleProposer, SpecEngineLoop
from tests.core.test_scheduler_properties import run_stream, scenarios

PROMPT = [5, 6, 7, 8]


class FixedProposer(StatelessProposer):
    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts

    def propose(self, requests):  # type: ignore[no-untyped-def]
        return [self.drafts[: r.max_drafts] for r in requests]


def _spec_scheduler(k: int = 3, **kwargs):  # type: ignore[no-untyped-def]
    spec = SpeculativeConfig(num_speculative_tokens=k, min_acceptance_rate=0.0)
    return make_scheduler(speculative_config=spec, **kwargs)


def _prefill(sched, request):  # type: ignore[no-untyped-def]
    sched.add_request(request)
    plan = sched.schedule()
    sched.update_from_output(plan, ModelRunnerOutput([request.request_id], [[1]]))


def test_rejected_drafts_are_taken_back_and_counted():
    sched = _spec_scheduler()
    request = make_request("0", PROMPT, max_tokens=20, ignore_eos=True)
    _prefill(sched, request)
    sched.proposer = FixedProposer([2, 3, 4])
    plan = sched.schedule()
    assert plan.scheduled_spec_decode_tokens == {"0": [2, 3, 4]}
    assert plan.num_scheduled_tokens == {"0": 4}
    assert request.num_computed_tokens == 4 + 1 + 3
    # Draft 2 accepted, 3 rejected (the target said 9).
    sched.update_from_output(plan, ModelRunnerOutput(["0"], [[2, 9]]))
    assert request.output_token_ids == [1, 2, 9]
    assert request.num_computed_tokens == len(request.all_token_ids) - 1
    stats = sched.get_stats()
    assert (stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens) == (3, 1)
    assert stats.spec_decode_accepted_per_position == (1, 0, 0)
    check_scheduler_invariants(sched)


def test_drafts_stop_short_of_max_tokens_and_stop_inside_a_run():
    sched = _spec_scheduler(k=4)
    capped = make_request("0", PROMPT, max_tokens=3, ignore_eos=True)
    stopped = make_request("1", [9, 9, 9], max_tokens=20, stop_token_ids=[3])
    for request in (capped, stopped):
        sched.add_request(request)
    plan = sched.schedule()
    sched.update_from_output(plan, ModelRunnerOutput(["0", "1"], [[1], [1]]))
    sched.proposer = FixedProposer([2, 3, 4, 5])
    plan = sched.schedule()
    # max_tokens=3 with one output: at most 1 draft + the target's token.
    assert plan.scheduled_spec_decode_tokens == {"0": [2], "1": [2, 3, 4, 5]}
    logprobs = LogprobsLists([[t] for t in (2, 3, 4, 5, 6)], [[-1.0]] * 5, [1] * 5)
    outs = sched.update_from_output(plan, ModelRunnerOutput(
        ["0", "1"], [[2, 7], [2, 3, 4, 5, 6]], logprobs={"1": logprobs}))
    by_id = {o.req_id: o for o in outs}
    assert by_id["0"].new_token_ids == [2, 7] and by_id["0"].finish_reason == "length"
    assert by_id["1"].new_token_ids == [2, 3] and by_id["1"].finish_reason == "stop"
    assert by_id["1"].new_logprobs is not None
    assert by_id["1"].new_logprobs.token_ids == [[2], [3]]
    assert not sched.requests
    check_scheduler_invariants(sched)


def test_no_drafts_above_the_batch_size_limit():
    spec = SpeculativeConfig(disable_by_batch_size=1, min_acceptance_rate=0.0)
    sched = make_scheduler(speculative_config=spec)
    for rid in ("0", "1"):
        sched.add_request(make_request(rid, PROMPT, ignore_eos=True))
    plan = sched.schedule()
    sched.update_from_output(plan, ModelRunnerOutput(["0", "1"], [[1], [1]]))
    sched.proposer = FixedProposer([2])
    assert not sched.speculating()
    assert sched.schedule().scheduled_spec_decode_tokens == {}


def test_requests_with_penalties_or_bad_words_do_not_draft():
    """Their sampling reads the output history row by row: penalties' counts, and bad words'
    recent tokens, which hold the kept outputs only, not the drafts a verifying row follows."""
    sched = _spec_scheduler(k=2)
    kinds = [{}, {"repetition_penalty": 1.1}, {"bad_words_token_ids": [[9, 9]]},
             {"bad_words": ["x"]}]
    rids = [str(i) for i in range(len(kinds))]
    for rid, sampling in zip(rids, kinds, strict=True):
        sched.add_request(make_request(rid, PROMPT, max_tokens=20, ignore_eos=True, **sampling))
    plan = sched.schedule()
    sched.update_from_output(plan, ModelRunnerOutput(rids, [[1]] * len(rids)))
    sched.proposer = FixedProposer([2, 3])
    assert sched.schedule().scheduled_spec_decode_tokens == {"0": [2, 3]}
    check_scheduler_invariants(sched)


def test_a_request_that_keeps_rejecting_pauses():
    sched = _spec_scheduler(k=2)
    sched.draft_gate.min_rate = 0.5
    request = make_request("0", PROMPT, max_tokens=40, ignore_eos=True)
    _prefill(sched, request)
    sched.proposer = FixedProposer([2, 2])
    drafted = []
    for _ in range(8):
        plan = sched.schedule()
        drafted.append(bool(plan.scheduled_spec_decode_tokens))
        sched.update_from_output(plan, ModelRunnerOutput(["0"], [[9]]))  # every draft rejected
    assert drafted[0] and not all(drafted)
    assert drafted.index(False) <= 3


@settings(max_examples=60, deadline=None)
@given(scenarios())
def test_random_streams_with_drafts_equal_the_reference(scenario):
    config, ops = scenario
    sched = make_scheduler(**config, speculative_config=SpeculativeConfig(
        num_speculative_tokens=3, min_acceptance_rate=0.0))
    run_stream(SpecEngineLoop(sched, OracleProposer()), ops, config["max_model_len"])
    stats = sched.get_stats()
    event(f"accepted drafts: {stats.spec_decode_num_accepted_tokens > 0}")
    event(f"preempted: {stats.num_preemptions > 0}")
    assert sched.kv_cache_manager.usage == 0.0


def test_ngram_plans_asynchronously_until_a_lookup_finds_a_match():
    """Where the text does not repeat, steps may be planned past each other; a lookup over the
    known tokens of a request with a step in flight that finds a match makes the next step
    synchronous, and only a step planned with the last token known drafts."""
    spec = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1,
                             min_acceptance_rate=0.0)
    sched = make_scheduler(speculative_config=spec, async_scheduling=True)
    request = make_request("0", [5, 6, 7, 8], max_tokens=20, ignore_eos=True)
    sched.add_request(request)
    prefill = sched.schedule()
    assert sched.speculating()  # a new request has not looked yet
    sched.update_from_output(prefill, ModelRunnerOutput(["0"], [[9]]))
    step = sched.schedule()  # [5, 6, 7, 8, 9]: nothing repeats
    assert step.scheduled_spec_decode_tokens == {} and not sched.speculating()
    ahead = sched.schedule()  # planned while `step` runs: the lookup sees [..., 9] only
    assert ahead.scheduled_spec_decode_tokens == {} and not sched.speculating()
    sched.update_from_output(step, ModelRunnerOutput(["0"], [[5]]))
    behind = sched.schedule()  # `ahead` in flight; known [..., 9, 5]: 5 was followed by 6
    assert behind.scheduled_spec_decode_tokens == {} and sched.speculating()
    sched.update_from_output(ahead, ModelRunnerOutput(["0"], [[6]]))
    sched.update_from_output(behind, ModelRunnerOutput(["0"], [[7]]))
    drafting = sched.schedule()  # every token known: [..., 5, 6, 7] -> 8, 9
    assert drafting.scheduled_spec_decode_tokens == {"0": [8, 9]}
    check_scheduler_invariants(sched)
