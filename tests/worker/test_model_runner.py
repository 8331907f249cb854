"""The runner against transformers on a tiny random Llama: greedy tokens, logprobs, chunked
prefill, preemption, padding rows; all driven by hand-built plans."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from pagedserve.attention.backends.base import PAD_SLOT_ID
from pagedserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.tracer import RecordingTracer, tracing
from tests.worker.conftest import TINY_LLAMA, RunnerFactory
from tests.worker.hand_plans import HandScheduler, hf_greedy, random_prompt, run_step

BLOCK_SIZE = 4


def _prompt(n: int, seed: int) -> list[int]:
    return random_prompt(n, seed, TINY_LLAMA["vocab_size"])


def test_chunked_prefill_then_decode_matcheshf_greedy(
    make_runner: RunnerFactory, hf_tiny_llama: LlamaForCausalLM
) -> None:
    runner = make_runner(block_size=BLOCK_SIZE)
    a, b = _prompt(11, 1), _prompt(7, 2)
    sched, outputs = HandScheduler(BLOCK_SIZE), {}
    with tracing(runner, RecordingTracer()) as tracer:
        first = run_step(runner, sched.step(new=[("A", a, 6), ("B", b, 7)]), outputs)
    assert first == {"A": [], "B": first["B"]} and len(first["B"]) == 1  # A's chunk is partial
    assert tracer.stops["logits"]["logits"].shape[0] == 1  # no logits for A's partial chunk
    run_step(runner, sched.step(running=[("A", 5), ("B", 1)]), outputs)
    for _ in range(5):
        run_step(runner, sched.step(running=[("A", 1), ("B", 1)]), outputs)
    assert outputs["A"] == hf_greedy(hf_tiny_llama, a, 6)
    assert outputs["B"] == hf_greedy(hf_tiny_llama, b, 7)


def test_preempted_request_resumes_from_its_outputs(
    make_runner: RunnerFactory, hf_tiny_llama: LlamaForCausalLM
) -> None:
    runner = make_runner(block_size=BLOCK_SIZE)
    a, b = _prompt(9, 3), _prompt(5, 4)
    sched, outputs = HandScheduler(BLOCK_SIZE), {}
    run_step(runner, sched.step(new=[("A", a, 9), ("B", b, 5)]), outputs)
    for _ in range(2):
        run_step(runner, sched.step(running=[("A", 1), ("B", 1)]), outputs)
    run_step(runner, sched.step(running=[("B", 1)], preempted={"A"}), outputs)
    assert "A" not in runner.states.req_id_to_index
    history = a + outputs["A"]  # prompt plus the 3 tokens generated before preemption
    run_step(runner, sched.step(new=[("A", history, 7)], running=[("B", 1)],
                            num_prompt_tokens={"A": len(a)}), outputs)
    run_step(runner, sched.step(running=[("A", len(history) - 7), ("B", 1)]), outputs)
    for _ in range(2):
        run_step(runner, sched.step(running=[("A", 1), ("B", 1)]), outputs)
    assert outputs["A"] == hf_greedy(hf_tiny_llama, a, 6)
    assert outputs["B"] == hf_greedy(hf_tiny_llama, b, 8)


def test_logprobs_and_prompt_logprobs_match_hf(
    make_runner: RunnerFactory, hf_tiny_llama: LlamaForCausalLM
) -> None:
    runner = make_runner(block_size=BLOCK_SIZE)
    prompt = _prompt(10, 5)
    params = {"A": SamplingParams(temperature=0.0, logprobs=3, prompt_logprobs=2)}
    sched = HandScheduler(BLOCK_SIZE)
    results: list[ModelRunnerOutput] = []
    for plan in (sched.step(new=[("A", prompt, 4)], params=params),
                 sched.step(running=[("A", 6)]), sched.step(running=[("A", 1)])):
        runner.execute_model(plan)
        results.append(runner.sample_tokens())
    generated = [results[1].sampled_token_ids[0][0], results[2].sampled_token_ids[0][0]]
    with torch.no_grad():
        logits = hf_tiny_llama(torch.tensor([prompt + generated])).logits[0].float()
    hf_logprobs = logits.log_softmax(-1)  # [12, V]

    chunks = [results[0].prompt_logprobs["A"], results[1].prompt_logprobs["A"]]
    assert [len(c.token_ids) for c in chunks] == [4, 5]  # tokens 1..4, then 5..9
    rows = [r for c in chunks for r in zip(c.token_ids, c.logprobs, strict=True)]
    for pos, (ids, lps) in enumerate(rows):  # hidden state at pos predicts token pos + 1
        assert ids[0] == prompt[pos + 1] and len(ids) == 3
        assert ids[1:] == hf_logprobs[pos].topk(2).indices.tolist()
        torch.testing.assert_close(torch.tensor(lps), hf_logprobs[pos, ids], atol=1e-4, rtol=0)
    assert "A" not in results[2].prompt_logprobs

    for step, pos in ((1, 9), (2, 10)):
        lp = results[step].logprobs["A"]
        ids = lp.token_ids[0]
        assert ids[0] == generated[step - 1] and lp.ranks == [1]  # greedy: the top token
        assert ids[1:] == hf_logprobs[pos].topk(3).indices.tolist()
        torch.testing.assert_close(torch.tensor(lp.logprobs[0]), hf_logprobs[pos, ids],
                                   atol=1e-4, rtol=0)
    assert results[0].logprobs == {}  # a partial chunk samples nothing


def test_uniform_decode_pads_tokens_to_the_full_descriptor(make_runner: RunnerFactory) -> None:
    runner = make_runner(block_size=BLOCK_SIZE)
    sched = HandScheduler(BLOCK_SIZE)
    runner.execute_model(sched.step(new=[(r, _prompt(5, i), 5) for i, r in enumerate("XYZ")]))
    runner.sample_tokens()
    with tracing(runner, RecordingTracer()) as tracer:
        runner.execute_model(sched.step(running=[(r, 1) for r in "XYZ"]))
        runner.sample_tokens()
    stops = tracer.stops
    assert stops["batch"]["uniform_decode_len"] == 1
    assert stops["batch"]["descriptor"] == {"mode": "FULL", "num_tokens": 4, "num_reqs": 4}
    assert stops["inputs"]["is_padding"].tolist() == [False, False, False, True]
    assert stops["attn"]["slot_mapping"][3].item() == PAD_SLOT_ID
    assert stops["metadata"]["metadata"]["num_reqs"] == 3  # eager: requests are not padded
    assert stops["forward"]["hidden_states"].shape[0] == 4


def test_mixed_batch_pads_on_the_sparse_piecewise_ladder(make_runner: RunnerFactory) -> None:
    # 70 tokens: FULL would pad to 72, PIECEWISE pads to 128; the buffers hold the larger.
    runner = make_runner(max_num_batched_tokens=70, block_size=BLOCK_SIZE)
    assert runner.max_num_tokens == 128 and runner.buffers.input_ids.shape[0] >= 128
    sched = HandScheduler(BLOCK_SIZE)
    with tracing(runner, RecordingTracer()) as tracer:
        runner.execute_model(sched.step(new=[("A", _prompt(69, 1), 69), ("B", [5], 1)]))
        assert len(runner.sample_tokens().req_ids) == 2
    stops = tracer.stops
    assert stops["batch"]["descriptor"] == {"mode": "PIECEWISE", "num_tokens": 128,
                                            "num_reqs": None}
    assert stops["batch"]["capture_sizes"][-3:] == [384, 448, 512]  # the sparse ladder
    assert stops["inputs"]["is_padding"].tolist() == [False] * 70 + [True] * 58
    assert stops["forward"]["hidden_states"].shape[0] == 128


def test_finished_requests_free_their_slots(make_runner: RunnerFactory) -> None:
    runner = make_runner(max_num_seqs=2, block_size=BLOCK_SIZE)
    sched = HandScheduler(BLOCK_SIZE)
    runner.execute_model(sched.step(new=[("A", [1, 2], 2), ("B", [3], 1)]))
    runner.sample_tokens()
    assert runner.states.req_id_to_index == {"A": 1, "B": 0}
    runner.execute_model(sched.step(new=[("C", [4, 5], 2)], running=[("B", 1)],
                                    finished={"A"}))
    assert runner.sample_tokens().req_ids == ["B", "C"]
    assert runner.states.req_id_to_index == {"B": 0, "C": 1}


def test_step_without_tokens_returns_an_empty_output(make_runner: RunnerFactory) -> None:
    runner = make_runner(block_size=BLOCK_SIZE)
    runner.execute_model(SchedulerOutput.empty())
    assert runner.sample_tokens() == ModelRunnerOutput.empty()


def test_bad_plans_are_refused(make_runner: RunnerFactory) -> None:
    runner = make_runner(block_size=BLOCK_SIZE)
    plan = HandScheduler(BLOCK_SIZE).step(new=[("A", [1, 2, 3, 4, 5], 5)])
    plan.scheduled_new_reqs[0].block_ids = ([1],)  # 4 token slots for 5 tokens
    with pytest.raises(ValueError, match="block_ids"):
        runner.execute_model(plan)
    plan = HandScheduler(BLOCK_SIZE).step(new=[("B", [1, 2], 2)])
    plan.total_num_scheduled_tokens = 3
    with pytest.raises(ValueError, match="total_num_scheduled_tokens"):
        runner.execute_model(plan)


def test_kv_cache_auto_dtype_is_the_models(make_runner: RunnerFactory) -> None:
    runner = make_runner(block_size=BLOCK_SIZE)
    assert runner.config.cache.kv_cache_dtype == "auto" and runner.dtype == torch.float32
    assert {cache.dtype for cache in runner.kv_caches.values()} == {torch.float32}
