"""Prometheus metrics of the server (``GET /metrics``), in a private registry.

Gauges and counters come from the engine core's ``SchedulerStats`` (sent with every engine
step); its counters are cumulative, so each update adds the difference to the last value seen.
Latency histograms are measured in the API process by ``AsyncLLM`` (it implements nothing
here: it calls the ``StatsObserver`` methods of ``ServerMetrics``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pagedserve.core.stats import SchedulerStats

PREFIX = "pagedserve:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)

_STAT_COUNTERS = {
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "num_preemptions": "Requests preempted (their KV blocks freed, to be recomputed).",
    "prompt_tokens": "Prompt tokens of requests that produced their first token.",
    "generation_tokens": "Generated tokens.",
    "grammar_compiles": "Structured outputs: grammars compiled.",
    "grammar_compile_seconds": "Structured outputs: seconds spent compiling grammars.",
    "grammar_cache_queries": "Structured outputs: compiled-grammar cache lookups.",
    "grammar_cache_hits": "Structured outputs: lookups that found the grammar compiled or compiling.",
    "spec_decode_num_drafts": "Speculative decoding: request-steps that verified drafts.",
    "spec_decode_num_draft_tokens": "Speculative decoding: draft tokens verified.",
    "spec_decode_num_accepted_tokens": "Speculative decoding: draft tokens accepted.",
}


class ServerMetrics:
    """Every metric of one served model; implements ``AsyncLLM``'s ``StatsObserver``."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=reg)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg)

        self.running = gauge("num_requests_running", "Requests in the running batch.").labels(
            model_name
        )
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.").labels(
            model_name
        )
        self.kv_usage = gauge(
            "kv_cache_usage_perc", "Fraction of KV blocks in use (0 to 1)."
        ).labels(model_name)
        self.prefix_hit_rate = gauge(
            "prefix_cache_hit_rate",
            "Prompt tokens found in the prefix cache / looked up, since the engine started.",
        ).labels(model_name)
        self.stat_counters = {
            name: Counter(PREFIX + name, doc, labels, registry=reg).labels(model_name)
            for name, doc in _STAT_COUNTERS.items()
        }
        self._last_counts = dict.fromkeys(_STAT_COUNTERS, 0)
        self.accepted_per_position = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: drafts accepted at each position of their run.",
            ["model_name", "position"], registry=reg)
        self._last_per_position: list[int] = []
        self.lora_info = Gauge(
            PREFIX + "lora_requests_info",
            "LoRA adapters of running and waiting requests (vLLM's): the labels name them, the "
            "value is the time of the step that reported them.",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=reg)
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished completions, by finish reason.",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        ).labels(model_name)
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Time between two outputs of a request.",
            _LATENCY_BUCKETS,
        ).labels(model_name)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to last output.", _REQUEST_BUCKETS
        ).labels(model_name)
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduling.", _REQUEST_BUCKETS
        ).labels(model_name)

    # -- StatsObserver -------------------------------------------------------------------------

    def on_step(self, stats: SchedulerStats, queue_times: list[float]) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.prefix_hit_rate.set(stats.prefix_cache_hit_rate)
        for name, counter in self.stat_counters.items():
            value = getattr(stats, name)
            # A restarted engine starts from 0 again: count from there.
            delta = value - self._last_counts[name] if value >= self._last_counts[name] else value
            if delta > 0:
                counter.inc(delta)
            self._last_counts[name] = value
        if stats.spec_decode_accepted_per_position:
            self._count_per_position(stats.spec_decode_accepted_per_position)
        if stats.max_loras:
            self._set_lora_info(stats)
        for seconds in queue_times:
            self.queue_time.observe(seconds)

    def _set_lora_info(self, stats: SchedulerStats) -> None:
        """One series, the current one (earlier label sets would linger as stale series)."""
        self.lora_info.clear()
        self.lora_info.labels(str(stats.max_loras), ",".join(stats.running_lora_adapters),
                              ",".join(stats.waiting_lora_adapters)).set_to_current_time()

    def _count_per_position(self, counts: tuple[int, ...]) -> None:
        last = self._last_per_position or [0] * len(counts)
        for position, (value, before) in enumerate(zip(counts, last, strict=True)):
            delta = value - before if value >= before else value
            if delta > 0:
                self.accepted_per_position.labels(self.model_name, str(position)).inc(delta)
        self._last_per_position = list(counts)

    def on_engine_dead(self) -> None:
        self.running.set(0)
        self.waiting.set(0)
        self.kv_usage.set(0.0)

    def on_first_token(self, ttft: float) -> None:
        self.ttft.observe(ttft)

    def on_inter_token(self, itl: float) -> None:
        self.itl.observe(itl)

    def on_completion_finished(self, finish_reason: str) -> None:
        self.request_success.labels(self.model_name, finish_reason).inc()

    def on_request_finished(self, e2e: float) -> None:
        self.e2e.observe(e2e)

    # -- exposition ----------------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)
