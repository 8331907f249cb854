"""The scheduler and constrained requests: a request waits for its grammar without holding up
others, a failed grammar aborts it, the matcher follows every appended token, and a
terminated grammar finishes the request with "stop"."""

from __future__ import annotations

from pagedserve.core.request import RequestStatus
from pagedserve.core.sched_output import ModelRunnerOutput
from tests.core.core_helpers import make_request, make_scheduler


class FakeGrammar:
    """Ready when told; accepts every token but ``reject``; terminates after ``length``."""

    def __init__(self, length: int = 100, reject: int = -1) -> None:
        self.ready, self.failure = False, None
        self.length, self.reject = length, reject
        self.accepted: list[int] = []

    def is_ready(self) -> bool:
        return self.ready

    def error(self) -> str | None:
        return self.failure

    def accept_token(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return token_id != self.reject

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length


def _constrained(rid: str, grammar: FakeGrammar, **kwargs):
    request = make_request(rid, [1, 2, 3], **kwargs)
    request.structured_output = grammar
    return request


def _step(scheduler, token: int = 5):
    plan = scheduler.schedule()
    ids = list(plan.num_scheduled_tokens)
    outputs = scheduler.update_from_output(plan, ModelRunnerOutput(ids, [[token] for _ in ids]))
    return plan, outputs


def test_a_compiling_grammar_holds_up_no_one():
    scheduler = make_scheduler()
    grammar = FakeGrammar()
    scheduler.add_request(_constrained("0", grammar))
    scheduler.add_request(make_request("1", [4, 5]))
    plan, _ = _step(scheduler)
    assert list(plan.num_scheduled_tokens) == ["1"]
    assert scheduler.requests["0"].status == RequestStatus.WAITING_FOR_GRAMMAR
    assert scheduler.get_stats().num_waiting == 1
    grammar.ready = True
    plan, _ = _step(scheduler)
    assert set(plan.num_scheduled_tokens) == {"0", "1"}
    assert grammar.accepted == [5]
    assert scheduler.num_constrained_requests == 1
    scheduler.abort_requests(["0"])
    assert scheduler.num_constrained_requests == 0


def test_a_failed_grammar_aborts_the_request():
    scheduler = make_scheduler()
    grammar = FakeGrammar()
    grammar.ready, grammar.failure = True, "RuntimeError: bad"
    scheduler.add_request(_constrained("0", grammar))
    plan = scheduler.schedule()
    assert plan.total_num_scheduled_tokens == 0 and scheduler.has_unfinished_requests()
    (failure,) = scheduler.take_rejected()
    assert failure.req_id == "0" and failure.finish_reason == "abort"
    assert scheduler.num_constrained_requests == 0
    assert not scheduler.has_unfinished_requests()


def test_a_terminated_grammar_stops_even_with_ignore_eos():
    scheduler = make_scheduler()
    grammar = FakeGrammar(length=3)
    grammar.ready = True
    scheduler.add_request(_constrained("0", grammar, ignore_eos=True))
    finished = []
    for _ in range(5):
        finished += [o for _, outs in [_step(scheduler)] for o in outs if o.finished]
    assert [o.finish_reason for o in finished] == ["stop"]
    assert grammar.accepted == [5, 5, 5]


def test_a_rejected_token_aborts_the_request():
    scheduler = make_scheduler()
    grammar = FakeGrammar(reject=5)
    grammar.ready = True
    scheduler.add_request(_constrained("0", grammar))
    _step(scheduler)  # the prefill samples the rejected token
    assert "0" not in scheduler.requests


def test_an_aborted_request_leaves_the_grammar_queue():
    scheduler = make_scheduler()
    scheduler.add_request(_constrained("0", FakeGrammar()))
    (output,) = scheduler.abort_requests(["0"])
    assert output.finish_reason == "abort" and not scheduler.waiting_for_grammar
