"""Counters the scheduler exposes after each step (read by logging and the /metrics endpoint)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    """Fraction of KV blocks held by requests (0.0 when all are free)."""
    prefix_cache_queries: int
    """Tokens looked up in the prefix cache (cumulative, once per admission)."""
    prefix_cache_hits: int
    """Tokens found in the prefix cache (cumulative)."""
    num_preemptions: int
    """Cumulative."""
    prompt_tokens: int
    """Prompt tokens of requests that produced their first token (cumulative)."""
    generation_tokens: int
    """Generated tokens appended (cumulative)."""
    grammar_compiles: int = 0
    """Structured outputs: grammars compiled (cumulative; the engine core fills these four)."""
    grammar_compile_seconds: float = 0.0
    """Time spent compiling them, on the compile threads (cumulative)."""
    grammar_cache_queries: int = 0
    """Constrained requests whose compiled grammar was looked up (cumulative)."""
    grammar_cache_hits: int = 0
    """Lookups that found the grammar compiled or compiling (cumulative)."""

    @property
    def prefix_cache_hit_rate(self) -> float:
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries
