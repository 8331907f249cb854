"""StatsLogger: the periodic line's wording and figures, and when it is logged (a fake clock)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from pagedserve.core.stats import SchedulerStats
from pagedserve.engine.stats_logger import StatsLogger, StatsWindow


def _stats(prompt: int, generated: int, running: int = 1, waiting: int = 0,
           preemptions: int = 0, queries: int = 0, hits: int = 0) -> SchedulerStats:
    return SchedulerStats(running, waiting, 0.25, queries, hits, preemptions, prompt, generated)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_line_reports_rates_since_the_window_start() -> None:
    before = _stats(100, 50, queries=100, hits=10, preemptions=1)
    now = _stats(1100, 550, running=3, waiting=2, queries=300, hits=110, preemptions=4)
    assert StatsWindow.between(before, now, 5.0).line() == (
        "Avg prompt throughput: 200.0 tokens/s, Avg generation throughput: 100.0 tokens/s, "
        "Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, "
        "Prefix cache hit rate: 50.0%, Preemptions: 3"
    )


def test_one_line_per_interval_while_busy(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    stats_logger = StatsLogger(interval=5.0, clock=clock)
    caplog.set_level(logging.INFO, logger="pagedserve.engine.stats_logger")
    clock.now += 4.9
    assert stats_logger.record(_stats(10, 10)) is None  # before the interval: nothing
    clock.now += 0.1
    window = stats_logger.record(_stats(50, 100))
    assert window is not None and window.seconds == pytest.approx(5.0)
    assert window.generation_tokens == 100 and len(caplog.records) == 1
    clock.now += 2.0
    assert stats_logger.record(_stats(50, 120)) is None
    clock.now += 3.0
    window = stats_logger.record(_stats(50, 150))
    assert window is not None and window.generation_tokens == 50  # since the previous line
    # Idle (nothing ran, nothing queued): no line.
    clock.now += 10.0
    assert stats_logger.record(_stats(50, 150, running=0)) is None
    assert [r.levelname for r in caplog.records] == ["INFO", "INFO"]


def test_preemptions_in_the_window_warn(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    stats_logger = StatsLogger(interval=5.0, clock=clock)
    caplog.set_level(logging.INFO, logger="pagedserve.engine.stats_logger")
    clock.now += 6.0
    stats_logger.record(_stats(10, 10, preemptions=65))
    warning = caplog.records[-1]
    assert warning.levelname == "WARNING"
    assert warning.getMessage().startswith("65 request(s) preempted in the last 6 s")


def test_speculative_decoding_acceptance_in_the_window(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    stats_logger = StatsLogger(interval=5.0, clock=clock)
    caplog.set_level(logging.INFO, logger="pagedserve.engine.stats_logger")

    def spec(drafts: int, tokens: int, accepted: int, per_position: tuple[int, ...]):
        return dataclasses.replace(_stats(10, 10 + accepted), spec_decode_num_drafts=drafts,
                                   spec_decode_num_draft_tokens=tokens,
                                   spec_decode_num_accepted_tokens=accepted,
                                   spec_decode_accepted_per_position=per_position)

    clock.now += 5.0
    stats_logger.record(spec(2, 4, 3, (2, 1)))
    clock.now += 5.0
    stats_logger.record(spec(6, 12, 7, (5, 2)))
    lines = [r.getMessage() for r in caplog.records if "drafts accepted" in r.getMessage()]
    assert lines[1].startswith("speculative decoding: 4 of 8 drafts accepted (0.50; per "
                               "position 0.75, 0.25)")
