"""The figures of ``bench serve``, named as ``vllm bench serve`` names them: throughputs, and
mean / median / std / percentiles of TTFT, TPOT, ITL and end-to-end latency, in milliseconds.

TPOT of a request is ``(latency - TTFT) / (output tokens - 1)`` (requests of one output token
have none); ITL is every gap between two text chunks of any request.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedserve.entrypoints.bench.serve_client import RequestResult

LATENCY_METRICS = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def parse_percentiles(text: str) -> list[float]:
    """``"90,99"`` -> [90.0, 99.0]; the median is always reported."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError as e:
        raise ValueError(f"metric_percentiles: expected numbers like 90,99, got {text!r}") from e
    if any(not 0 < p < 100 for p in values):
        raise ValueError(f"metric_percentiles: each must be in (0, 100), got {text!r}")
    return values


def latency_samples(results: list[RequestResult]) -> dict[str, list[float]]:
    """Seconds, per latency metric, over the successful requests."""
    ok = [r for r in results if r.success]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }


def summarize(
    results: list[RequestResult], duration: float, percentiles: list[float]
) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    for name, values in latency_samples(results).items():
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        summary[f"mean_{name}_ms"] = float(ms.mean()) if ms.size else 0.0
        summary[f"median_{name}_ms"] = float(np.median(ms)) if ms.size else 0.0
        summary[f"std_{name}_ms"] = float(ms.std()) if ms.size else 0.0
        for p in percentiles:
            value = float(np.percentile(ms, p)) if ms.size else 0.0
            summary[f"p{p:g}_{name}_ms"] = value
    return summary


def format_summary(summary: dict[str, Any], percentiles: list[float]) -> str:
    """The result table, as ``vllm bench serve`` prints it."""
    rows = [
        "{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
        f"{'Successful requests:':<40}{summary['completed']:<10}",
        f"{'Failed requests:':<40}{summary['failed']:<10}",
        f"{'Benchmark duration (s):':<40}{summary['duration']:<10.2f}",
        f"{'Total input tokens:':<40}{summary['total_input_tokens']:<10}",
        f"{'Total generated tokens:':<40}{summary['total_output_tokens']:<10}",
        f"{'Request throughput (req/s):':<40}{summary['request_throughput']:<10.2f}",
        f"{'Output token throughput (tok/s):':<40}{summary['output_throughput']:<10.2f}",
        f"{'Total token throughput (tok/s):':<40}{summary['total_token_throughput']:<10.2f}",
    ]
    for name, title in LATENCY_METRICS.items():
        rows.append("{s:{c}^50}".format(s=f" {title} ", c="-"))
        rows.append(f"{f'Mean {name.upper()} (ms):':<40}{summary[f'mean_{name}_ms']:<10.2f}")
        rows.append(f"{f'Median {name.upper()} (ms):':<40}{summary[f'median_{name}_ms']:<10.2f}")
        for p in percentiles:
            rows.append(
                f"{f'P{p:g} {name.upper()} (ms):':<40}{summary[f'p{p:g}_{name}_ms']:<10.2f}"
            )
    rows.append("=" * 50)
    return "\n".join(rows)
