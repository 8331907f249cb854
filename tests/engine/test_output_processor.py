"""OutputProcessor on hand-made engine-core outputs: kinds, n > 1, stop strings, logprobs."""

from __future__ import annotations

import math

import pytest

from pagedserve.core.sched_output import EngineCoreOutput, LogprobsLists
from pagedserve.engine.input_processor import InputProcessor
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.outputs import RequestOutputKind
from pagedserve.sampling_params import SamplingParams
from tests.engine.tiny_models import make_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture
def processor(tokenizer):
    return InputProcessor(tokenizer, 256, len(tokenizer), tokenizer.eos_token_id)


def _ids(tokenizer, text: str) -> list[int]:
    return [i for ch in text for i in tokenizer.encode(ch)]


def _drive(out_proc, req_id, token_ids, finish_last=None):
    """Feed one token per step; returns the per-step results."""
    results = []
    for k, t in enumerate(token_ids):
        last = k == len(token_ids) - 1
        reason = finish_last if last else None
        results.append(
            out_proc.process_outputs([EngineCoreOutput(req_id, [t], finish_reason=reason)])
        )
    return results


def test_final_only_reports_once_at_the_end(processor, tokenizer):
    out_proc = OutputProcessor(tokenizer)
    out_proc.add_request(processor.process_inputs("r", "Hi", SamplingParams()))
    ids = _ids(tokenizer, "abc")
    results = _drive(out_proc, "r", ids, finish_last="length")
    assert [len(r.request_outputs) for r in results] == [0, 0, 1]
    final = results[-1].request_outputs[0]
    assert final.finished and final.prompt == "Hi"
    assert final.outputs[0].text == "abc" and final.outputs[0].token_ids == ids
    assert final.outputs[0].finish_reason == "length"
    assert not out_proc.has_unfinished_requests()


def test_delta_and_cumulative_streams(processor, tokenizer):
    ids = _ids(tokenizer, "héllo")
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        out_proc = OutputProcessor(tokenizer)
        out_proc.add_request(processor.process_inputs("r", "Hi", SamplingParams()), kind)
        results = _drive(out_proc, "r", ids, finish_last="stop")
        outputs = [c for r in results for ro in r.request_outputs for c in ro.outputs]
        if kind is RequestOutputKind.DELTA:
            assert "".join(c.text for c in outputs) == "héll"  # the stop token is not text
            assert sum((c.token_ids for c in outputs), []) == ids
        else:
            assert outputs[-1].text == "héll" and outputs[-1].token_ids == ids
            assert all(
                b.text.startswith(a.text) for a, b in zip(outputs, outputs[1:], strict=False)
            )


def test_stop_string_finishes_and_asks_the_core_to_finish(processor, tokenizer):
    out_proc = OutputProcessor(tokenizer)
    params = SamplingParams(stop=["c d"])
    out_proc.add_request(processor.process_inputs("r", "Hi", params))
    results = _drive(out_proc, "r", _ids(tokenizer, "abc def"))
    stopped_at = next(k for k, r in enumerate(results) if r.reqs_to_finish)
    assert results[stopped_at].reqs_to_finish == ["r"]
    completion = results[stopped_at].request_outputs[0].outputs[0]
    assert completion.text == "ab"
    assert completion.finish_reason == "stop" and completion.stop_reason == "c d"
    assert stopped_at == 4  # "a b c ' ' d": the fifth token completes the stop string
    assert all(
        r.request_outputs == [] and r.reqs_to_finish == [] for r in results[stopped_at + 1 :]
    )


def test_n_children_fold_into_one_output(processor, tokenizer):
    out_proc = OutputProcessor(tokenizer)
    out_proc.add_request(processor.process_inputs("p", "Hi", SamplingParams(n=2, seed=1)))
    a, b = _ids(tokenizer, "ab")
    r1 = out_proc.process_outputs([EngineCoreOutput("0_p", [a]), EngineCoreOutput("1_p", [b])])
    assert r1.request_outputs == []
    r2 = out_proc.process_outputs([EngineCoreOutput("1_p", [a], finish_reason="length")])
    assert r2.request_outputs == []  # child 0 still runs
    r3 = out_proc.process_outputs([EngineCoreOutput("0_p", [b], finish_reason="length")])
    (final,) = r3.request_outputs
    assert final.request_id == "p" and final.finished
    assert [(c.index, c.text) for c in final.outputs] == [(0, "ab"), (1, "ba")]


def test_logprobs_and_cumulative_logprob(processor, tokenizer):
    out_proc = OutputProcessor(tokenizer)
    out_proc.add_request(processor.process_inputs("r", "Hi", SamplingParams(logprobs=1)))
    a, b = _ids(tokenizer, "ab")
    rows1 = LogprobsLists([[a, b]], [[-1.5, -0.5]], [2])
    rows2 = LogprobsLists([[b, b]], [[-0.25, -0.25]], [1])
    out_proc.process_outputs([EngineCoreOutput("r", [a], new_logprobs=rows1)])
    res = out_proc.process_outputs(
        [EngineCoreOutput("r", [b], new_logprobs=rows2, finish_reason="length")]
    )
    completion = res.request_outputs[0].outputs[0]
    assert math.isclose(completion.cumulative_logprob, -1.75)
    assert completion.logprobs[0][a].rank == 2 and completion.logprobs[0][b].rank == 1
    assert completion.logprobs[1] == {b: completion.logprobs[1][b]}
    assert completion.logprobs[0][a].decoded_token == "a"


def test_logprobs_absent_unless_asked(processor, tokenizer):
    out_proc = OutputProcessor(tokenizer)
    out_proc.add_request(processor.process_inputs("r", "Hi", SamplingParams()))
    res = out_proc.process_outputs([EngineCoreOutput("r", [5], finish_reason="length")])
    completion = res.request_outputs[0].outputs[0]
    assert completion.logprobs is None and completion.cumulative_logprob is None


def test_abort_returns_child_ids_and_ignores_late_outputs(processor, tokenizer):
    out_proc = OutputProcessor(tokenizer)
    out_proc.add_request(processor.process_inputs("p", "Hi", SamplingParams(n=3)))
    out_proc.process_outputs([EngineCoreOutput("1_p", [5], finish_reason="length")])
    assert out_proc.abort_requests(["p", "unknown"]) == ["0_p", "2_p"]
    assert not out_proc.has_unfinished_requests()
    assert out_proc.process_outputs([EngineCoreOutput("0_p", [5])]).request_outputs == []


def test_abort_reported_through_core_outputs(processor, tokenizer):
    out_proc = OutputProcessor(tokenizer)
    out_proc.add_request(processor.process_inputs("r", "Hi", SamplingParams()))
    res = out_proc.process_outputs([EngineCoreOutput("r", [], finish_reason="abort")])
    assert res.request_outputs[0].outputs[0].finish_reason == "abort"


def test_duplicate_request_id_rejected(processor, tokenizer):
    out_proc = OutputProcessor(tokenizer)
    out_proc.add_request(processor.process_inputs("r", "Hi", SamplingParams()))
    with pytest.raises(ValueError, match="request_id"):
        out_proc.add_request(processor.process_inputs("r", "Hi", SamplingParams()))
