"""Ctrl-C inside ``LLM.generate``: the interrupted requests are aborted (their KV blocks
freed), and the next ``generate`` on the same object returns the tokens a fresh object gives."""

from __future__ import annotations

import random
import signal
import threading
import time

import pytest

from pagedserve import LLM, SamplingParams
from tests.engine.tiny_models import save_checkpoint

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = ["Hello world", "Paris is", "one two three", "a b c d e f"]
MIN_INTERRUPTED = 6
MAX_TRIALS = 40
"""Trials go on until MIN_INTERRUPTED signals landed inside a generate: a signal timed from
one measured generate may land after a later, faster one returned (a busy machine's speed
drifts), so a fixed number of trials could fall short without anything being wrong."""


def _make_llm(folder) -> LLM:
    return LLM(
        model=str(folder),
        dtype="float32",
        max_model_len=64,
        num_gpu_blocks_override=32,
        max_num_seqs=4,
        block_size=4,
        enable_prefix_caching=True,
        seed=0,
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder, _, _ = save_checkpoint("llama", tmp_path_factory.mktemp("llama_interrupt"))
    return folder


@pytest.fixture(scope="module")
def expected(folder) -> list[list[int]]:
    fresh = _make_llm(folder)
    return [o.outputs[0].token_ids for o in fresh.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _assert_idle(llm: LLM) -> None:
    assert not llm.engine_core.has_unfinished_requests()
    assert not llm.output_processor.has_unfinished_requests()
    assert llm.engine_core.get_stats().kv_cache_usage == 0.0


def test_sigint_at_random_points(folder, expected):
    """A thread sends SIGINT to the main thread at a random moment of a generate, many times.
    The handler (Python's, while a generate runs) raises KeyboardInterrupt only inside the
    trial, so a signal that lands after generate returned cannot escape the test."""
    llm = _make_llm(folder)
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    duration = time.perf_counter() - start
    armed = [False]

    def handler(signum, frame):
        if armed[0]:
            signal.default_int_handler(signum, frame)

    previous = signal.signal(signal.SIGINT, handler)
    rng = random.Random(0)
    interrupted = 0
    try:
        trials = 0
        while interrupted < MIN_INTERRUPTED and trials < MAX_TRIALS:
            trials += 1
            timer = threading.Timer(
                rng.uniform(0, 0.8 * duration),
                signal.pthread_kill,
                (threading.main_thread().ident, signal.SIGINT),
            )
            try:
                armed[0] = True
                timer.start()
                llm.generate(PROMPTS, PARAMS, use_tqdm=False)
                armed[0] = False
            except KeyboardInterrupt:
                armed[0] = False
                interrupted += 1
            timer.join()
            _assert_idle(llm)
            assert _tokens(llm) == expected
    finally:
        signal.signal(signal.SIGINT, previous)
    print(f"SIGINT trials: {trials}, interrupted inside generate: {interrupted}")
    assert interrupted >= MIN_INTERRUPTED


@pytest.mark.parametrize("target", ["execute_model", "sample_tokens_async", "schedule"])
def test_interrupt_inside_a_step(folder, expected, target, monkeypatch):
    """KeyboardInterrupt raised from inside a step (after the plan advanced the requests)."""
    llm = _make_llm(folder)
    owner = llm.engine_core.scheduler if target == "schedule" else llm.engine_core.executor
    original = getattr(owner, target)
    for fail_at in (1, 3, 7, 15):
        calls = 0

        def failing(*args, _fail_at=fail_at, **kwargs):
            nonlocal calls
            calls += 1
            if calls == _fail_at:
                raise KeyboardInterrupt
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, target, failing)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        monkeypatch.setattr(owner, target, original)
        _assert_idle(llm)
        assert _tokens(llm) == expected
