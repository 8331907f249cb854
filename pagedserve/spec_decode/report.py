"""Speculative decoding's figures for reports (``bench`` output, the server's periodic log):
from the scheduler's cumulative ``SchedulerStats``."""

from __future__ import annotations

import dataclasses

from pagedserve.core.stats import SchedulerStats


def spec_decode_figures(stats: SchedulerStats) -> dict:
    """Draft and accepted counts, the acceptance rate overall and per draft position (the
    fraction of drafting request-steps that accepted a draft there); {} without drafts."""
    if stats.spec_decode_num_drafts == 0:
        return {}
    return {
        "spec_decode_num_drafts": stats.spec_decode_num_drafts,
        "spec_decode_num_draft_tokens": stats.spec_decode_num_draft_tokens,
        "spec_decode_num_accepted_tokens": stats.spec_decode_num_accepted_tokens,
        "spec_decode_acceptance_rate": stats.spec_decode_acceptance_rate,
        "spec_decode_acceptance_per_position": [
            n / stats.spec_decode_num_drafts for n in stats.spec_decode_accepted_per_position],
        "spec_decode_mean_accepted_length": 1 + (stats.spec_decode_num_accepted_tokens
                                                 / stats.spec_decode_num_drafts),
    }


def spec_decode_delta(before: SchedulerStats, now: SchedulerStats) -> SchedulerStats:
    """``now`` with its speculative-decoding counters taken since ``before``."""
    per_position = before.spec_decode_accepted_per_position or (0,) * len(
        now.spec_decode_accepted_per_position)
    return dataclasses.replace(
        now,
        spec_decode_num_drafts=now.spec_decode_num_drafts - before.spec_decode_num_drafts,
        spec_decode_num_draft_tokens=(now.spec_decode_num_draft_tokens
                                      - before.spec_decode_num_draft_tokens),
        spec_decode_num_accepted_tokens=(now.spec_decode_num_accepted_tokens
                                         - before.spec_decode_num_accepted_tokens),
        spec_decode_accepted_per_position=tuple(
            a - b for a, b in zip(now.spec_decode_accepted_per_position, per_position,
                                  strict=True)),
    )


def spec_decode_line(figures: dict) -> str:
    """One line of ``spec_decode_figures``; empty without drafts."""
    if not figures:
        return ""
    per_position = ", ".join(f"{r:.2f}" for r in figures["spec_decode_acceptance_per_position"])
    return (f"speculative decoding: {figures['spec_decode_num_accepted_tokens']} of "
            f"{figures['spec_decode_num_draft_tokens']} drafts accepted "
            f"({figures['spec_decode_acceptance_rate']:.2f}; per position {per_position}), "
            f"{figures['spec_decode_mean_accepted_length']:.2f} tokens per drafting step")
