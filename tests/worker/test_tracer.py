"""The step observer: a traced step records every stop in order; an untraced step runs no code
of the tracer module at all."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest

import pagedserve.worker.tracer as tracer_module
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.tracer import PHASES, RecordingTracer, tracing
from tests.worker.conftest import TINY_LLAMA, RunnerFactory
from tests.worker.hand_plans import HandScheduler, random_prompt, run_step

BLOCK_SIZE = 4
STOPS = ["plan", "batch", "inputs", "attn", "metadata", "forward", "logits", "sample"]


def _tracer_calls(steps: Callable[[], None]) -> list[str]:
    """The functions of ``worker/tracer.py`` that Python entered while ``steps`` ran."""
    calls: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename == tracer_module.__file__:
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        steps()
    finally:
        sys.setprofile(None)
    return calls


def _decode_steps(runner: ModelRunner, sched: HandScheduler, n: int) -> Callable[[], None]:
    def steps() -> None:
        for _ in range(n):
            run_step(runner, sched.step(running=[("A", 1), ("B", 1)]), {})

    return steps


def _started(make_runner: RunnerFactory) -> tuple[ModelRunner, HandScheduler]:
    runner, sched = make_runner(block_size=BLOCK_SIZE), HandScheduler(BLOCK_SIZE)
    prompts = [random_prompt(n, n, TINY_LLAMA["vocab_size"]) for n in (6, 3)]
    run_step(runner, sched.step(new=[("A", prompts[0], 6), ("B", prompts[1], 3)]), {})
    return runner, sched


def test_untraced_steps_run_no_tracer_code(make_runner: RunnerFactory) -> None:
    runner, sched = _started(make_runner)
    assert _tracer_calls(_decode_steps(runner, sched, 3)) == []
    with tracing(runner, RecordingTracer()):
        traced = _tracer_calls(_decode_steps(runner, sched, 1))
    assert "snapshot" in traced and "_record_plan" in traced  # the probe sees tracer code
    assert not set(PHASES) & set(vars(runner))  # leaving the block restores the class methods
    assert _tracer_calls(_decode_steps(runner, sched, 3)) == []


def test_traced_step_records_every_stop_in_order(make_runner: RunnerFactory) -> None:
    runner, sched = _started(make_runner)
    with tracing(runner, RecordingTracer()) as tracer:
        _decode_steps(runner, sched, 1)()
    assert list(tracer.stops) == STOPS
    assert tracer.stops["batch"]["req_ids"] == ["A", "B"]
    assert tracer.stops["sample"]["sampled_token_ids"].shape == (2,)


def test_a_runner_is_traced_once_at_a_time(make_runner: RunnerFactory) -> None:
    runner = make_runner(block_size=BLOCK_SIZE)
    with tracing(runner, RecordingTracer()), pytest.raises(RuntimeError, match="already"):
        with tracing(runner, RecordingTracer()):
            pass
