"""Speculative decoding's counters on /metrics and in the bench figures."""

from __future__ import annotations

from prometheus_client import generate_latest

from pagedserve.core.stats import SchedulerStats
from pagedserve.entrypoints.openai.metrics import ServerMetrics
from pagedserve.spec_decode.report import spec_decode_figures, spec_decode_line


def _stats(drafts: int, draft_tokens: int, accepted: int, per_position: tuple[int, ...]):
    return SchedulerStats(1, 0, 0.1, 0, 0, 0, 0, 0, spec_decode_num_drafts=drafts,
                          spec_decode_num_draft_tokens=draft_tokens,
                          spec_decode_num_accepted_tokens=accepted,
                          spec_decode_accepted_per_position=per_position)


def test_metrics_count_drafts_accepted_and_per_position():
    metrics = ServerMetrics("m")
    metrics.on_step(_stats(2, 6, 3, (2, 1, 0)), [])
    metrics.on_step(_stats(3, 9, 5, (3, 2, 0)), [])
    text = generate_latest(metrics.registry).decode()
    assert 'pagedserve:spec_decode_num_draft_tokens_total{model_name="m"} 9.0' in text
    assert 'pagedserve:spec_decode_num_accepted_tokens_total{model_name="m"} 5.0' in text
    assert ('pagedserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",'
            'position="1"} 2.0') in text


def test_bench_figures():
    assert spec_decode_figures(_stats(0, 0, 0, (0, 0))) == {}
    figures = spec_decode_figures(_stats(4, 12, 6, (4, 2, 0)))
    assert figures["spec_decode_acceptance_rate"] == 0.5
    assert figures["spec_decode_acceptance_per_position"] == [1.0, 0.5, 0.0]
    assert figures["spec_decode_mean_accepted_length"] == 2.5
    assert "6 of 12 drafts accepted (0.50; per position 1.00, 0.50, 0.00)" in spec_decode_line(
        figures)
