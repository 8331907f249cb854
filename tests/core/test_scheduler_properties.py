"""Property tests: random streams of add / step / abort on a small pool.

After every operation: reference counts equal holders, the free queue holds exactly the free
blocks (a double free raises inside the pool), plans respect the token budget and max_num_seqs,
and the fake runner checks every KV read against the request's own history. At the end every
request has finished, outputs of requests that were not aborted equal the unpaged reference,
and every block is free."""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from tests.core.core_helpers import (
    VOCAB,
    EngineLoop,
    check_scheduler_invariants,
    make_request,
    make_scheduler,
    reference_output,
)

BASE = [(3 * i + 1) % VOCAB for i in range(32)]  # shared prompt prefix source

add_op = st.tuples(
    st.just("add"),
    st.sampled_from([0, 2, 4, 8]) | st.integers(0, 12),  # tokens from the shared prefix
    st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=4),  # own suffix
    st.integers(1, 16),  # max_tokens
    st.integers(0, 3),  # min_tokens (clipped to max_tokens)
    st.integers(0, 2),  # priority
    st.sampled_from([(), (5,), (2, 7)]),  # stop_token_ids
    st.booleans(),  # ignore_eos
)
step_op = st.tuples(st.just("step"))
abort_op = st.tuples(st.just("abort"), st.integers(0, 20))


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.integers(6, 20))
    min_blocks = -(-max_model_len // block_size) + 1
    chunked = draw(st.booleans())
    config = dict(
        num_blocks=min_blocks + draw(st.integers(0, 2)),
        block_size=block_size,
        max_model_len=max_model_len,
        enable_prefix_caching=draw(st.booleans()),
        max_num_seqs=draw(st.integers(1, 5)),
        max_num_batched_tokens=draw(st.integers(1 if chunked else max_model_len, 24)),
        enable_chunked_prefill=chunked,
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        async_scheduling=draw(st.booleans()),
        admission_policy=draw(st.sampled_from(["reserve", "ratio", "greedy"])),
    )
    ops = draw(
        st.lists(st.one_of(add_op, add_op, step_op, step_op, abort_op), min_size=8, max_size=50)
    )
    return config, ops


def _add(loop: EngineLoop, rid: str, op: tuple, max_model_len: int):
    _, prefix_len, suffix, max_tokens, min_tokens, priority, stop_ids, ignore_eos = op
    prompt = (BASE[:prefix_len] + suffix)[:max_model_len] or [1]
    request = make_request(
        rid,
        prompt,
        max_tokens=max_tokens,
        priority=priority,
        arrival_time=float(rid),
        min_tokens=min(min_tokens, max_tokens),
        stop_token_ids=list(stop_ids),
        ignore_eos=ignore_eos,
    )
    loop.sched.add_request(request)
    return request


def run_stream(loop: EngineLoop, ops: list, max_model_len: int) -> None:
    """Apply ``ops``, finish every request, and hold the outputs to the unpaged reference."""
    sched = loop.sched
    requests, aborted = {}, set()
    for op in ops:
        if op[0] == "add":
            rid = str(len(requests))
            requests[rid] = _add(loop, rid, op, max_model_len)
        elif op[0] == "step":
            loop.step()
        elif requests:
            rid = str(op[1] % len(requests))
            if rid not in loop.finish_reasons:
                aborted.add(rid)
            loop.abort([rid])
        check_scheduler_invariants(sched)

    loop.run_until_done(max_steps=2000)
    check_scheduler_invariants(sched)
    assert set(loop.finish_reasons) == set(requests)
    for rid, request in requests.items():
        expected_tokens, expected_reason = reference_output(request, max_model_len)
        got = loop.tokens.get(rid, [])
        if rid in aborted:
            assert loop.finish_reasons[rid] == "abort"
            assert got == expected_tokens[: len(got)]
        else:
            assert (got, loop.finish_reasons[rid]) == (expected_tokens, expected_reason)
    assert sched.get_stats().generation_tokens == sum(
        len(loop.tokens.get(rid, [])) for rid in requests)


@settings(max_examples=100, deadline=None)
@given(scenarios())
def test_random_streams_keep_invariants_and_finish(scenario):
    config, ops = scenario
    sched = make_scheduler(**config)
    loop = EngineLoop(sched)
    run_stream(loop, ops, config["max_model_len"])
    stats = sched.get_stats()
    event(f"preempted: {stats.num_preemptions > 0}")
    event(f"prefix hits: {stats.prefix_cache_hits > 0}")
    assert sched.kv_cache_manager.usage == 0.0
    assert sched.kv_cache_manager.block_pool.num_free_blocks == config["num_blocks"] - 1
    assert stats.prefix_cache_hits <= stats.prefix_cache_queries
