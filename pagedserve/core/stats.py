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
    spec_decode_num_drafts: int = 0
    """Speculative decoding: request-steps that verified drafts (cumulative, as the next three)."""
    spec_decode_num_draft_tokens: int = 0
    """Draft tokens verified."""
    spec_decode_num_accepted_tokens: int = 0
    """Draft tokens accepted."""
    spec_decode_accepted_per_position: tuple[int, ...] = ()
    """Entry i: drafts accepted at position i of their run (k entries)."""
    max_loras: int = 0
    """LoRA: adapters the running requests may use at once (0: the engine serves none)."""
    running_lora_adapters: tuple[str, ...] = ()
    """LoRA: the names of the adapters running requests use, sorted."""
    waiting_lora_adapters: tuple[str, ...] = ()
    """LoRA: the names of the adapters waiting requests use, sorted."""

    @property
    def spec_decode_acceptance_rate(self) -> float:
        if self.spec_decode_num_draft_tokens == 0:
            return 0.0
        return self.spec_decode_num_accepted_tokens / self.spec_decode_num_draft_tokens

    @property
    def prefix_cache_hit_rate(self) -> float:
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries


class SpecDecodeCounts:
    """The scheduler's running totals of speculative decoding."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
