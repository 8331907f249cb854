"""The server's periodic log line, in vLLM's spirit: throughput, queue, KV cache, prefix cache.

``StatsLogger.record`` takes the scheduler's cumulative ``SchedulerStats`` after each engine
step; at most once per ``interval`` seconds, and only while the engine is busy (or just was),
it logs one INFO line with the rates since the previous line, one more with speculative
decoding's acceptance when drafts ran in that window, and a WARNING when requests were
preempted in it (the KV cache is too small for the load).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.core.stats import SchedulerStats
from pagedserve.spec_decode.report import spec_decode_delta, spec_decode_figures, spec_decode_line

logger = logging.getLogger(__name__)

LOG_STATS_INTERVAL_S = 5.0
"""Seconds between two stats lines (vLLM's default)."""


@dataclass(frozen=True)
class StatsWindow:
    """What happened between two stats lines."""

    seconds: float
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    now: SchedulerStats
    """The stats at the window's end (running, waiting and KV usage are read from it)."""

    @classmethod
    def between(cls, before: SchedulerStats, now: SchedulerStats, seconds: float) -> StatsWindow:
        return cls(
            seconds,
            now.prompt_tokens - before.prompt_tokens,
            now.generation_tokens - before.generation_tokens,
            now.prefix_cache_queries - before.prefix_cache_queries,
            now.prefix_cache_hits - before.prefix_cache_hits,
            now.num_preemptions - before.num_preemptions,
            now,
        )

    @property
    def idle(self) -> bool:
        """Nothing ran in the window and nothing is queued: no line to log."""
        busy = self.now.num_running or self.now.num_waiting
        return not (busy or self.prompt_tokens or self.generation_tokens)

    def line(self) -> str:
        hit_rate = self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        return (
            f"Avg prompt throughput: {self.prompt_tokens / self.seconds:.1f} tokens/s, "
            f"Avg generation throughput: {self.generation_tokens / self.seconds:.1f} tokens/s, "
            f"Running: {self.now.num_running} reqs, Waiting: {self.now.num_waiting} reqs, "
            f"KV cache usage: {100 * self.now.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {100 * hit_rate:.1f}%, Preemptions: {self.preemptions}"
        )


class StatsLogger:
    """Logs a ``StatsWindow`` every ``interval`` seconds of ``clock`` while the engine works."""

    def __init__(
        self,
        interval: float = LOG_STATS_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = interval
        self.clock = clock
        self._last_time = clock()
        self._last_stats: SchedulerStats | None = None
        """The stats at the previous line (None: none seen yet; counters start at zero)."""

    def record(self, stats: SchedulerStats) -> StatsWindow | None:
        """Take the stats after one step; returns the window it logged, if it logged one."""
        now = self.clock()
        if now - self._last_time < self.interval:
            return None
        before = self._last_stats or SchedulerStats(0, 0, 0.0, 0, 0, 0, 0, 0)
        window = StatsWindow.between(before, stats, now - self._last_time)
        self._last_time, self._last_stats = now, stats
        if window.idle:
            return None
        logger.info("%s", window.line())
        spec_line = spec_decode_line(spec_decode_figures(spec_decode_delta(before, stats)))
        if spec_line:
            logger.info("%s", spec_line)
        if window.preemptions:
            logger.warning(
                "%d request(s) preempted in the last %.0f s: the KV cache cannot hold the "
                "running batch (raise --gpu-memory-utilization or --kv-cache-memory, or lower "
                "--max-num-seqs)", window.preemptions, window.seconds,
            )
        return window
