"""What ``bench serve`` writes: a JSON file (the run's settings, the summary, and each request's
lengths and latencies) and a PNG with four latency plots (matplotlib, the ``bench`` extra)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pagedserve.entrypoints.bench.serve_client import RequestResult
from pagedserve.entrypoints.bench.serve_metrics import latency_samples


def write_json(
    path: Path, settings: dict[str, Any], summary: dict[str, Any], results: list[RequestResult]
) -> None:
    start = min((r.start for r in results), default=0.0)
    per_request = [{**asdict(r), "start": r.start - start} for r in results]
    payload = {**settings, **summary, "requests": per_request}
    path.write_text(json.dumps(payload, indent=2) + "\n")


def write_plot(path: Path, title: str, results: list[RequestResult]) -> None:
    """TTFT, TPOT and ITL histograms, and each request's latency against its send time."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ValueError(
            "plot: matplotlib is needed for the PNG (pip install 'pagedserve[bench]')"
        ) from e
    samples = latency_samples(results)
    fig = Figure(figsize=(11, 8), layout="constrained")
    fig.suptitle(title)
    axes = fig.subplots(2, 2)
    for ax, name, label in (
        (axes[0][0], "ttft", "time to first token (ms)"),
        (axes[0][1], "tpot", "time per output token (ms)"),
        (axes[1][0], "itl", "inter-token latency (ms)"),
    ):
        values = [v * 1000.0 for v in samples[name]]
        ax.hist(values, bins=min(50, max(5, len(values) // 4)), color="tab:blue")
        ax.set_xlabel(label)
        ax.set_ylabel("count")
    _latency_over_time(axes[1][1], results)
    fig.savefig(path, dpi=100)


def _latency_over_time(ax: Any, results: list[RequestResult]) -> None:
    start = min((r.start for r in results), default=0.0)
    ok = [r for r in results if r.success]
    sent = [r.start - start for r in ok]
    ax.scatter(sent, [r.latency * 1000.0 for r in ok], s=8, label="end-to-end")
    ax.scatter(sent, [r.ttft * 1000.0 for r in ok], s=8, label="first token")
    failed = [r.start - start for r in results if not r.success]
    if failed:
        ax.scatter(failed, [0.0] * len(failed), s=12, marker="x", color="red", label="failed")
    ax.set_xlabel("sent at (s from the start)")
    ax.set_ylabel("latency (ms)")
    ax.legend()
