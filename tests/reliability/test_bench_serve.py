"""``pagedserve bench serve`` against a real server (JSON and PNG written, every request
counted), and its arithmetic: Poisson gaps, prompt lengths, TTFT / TPOT / ITL."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pagedserve.entrypoints.bench.serve_client import RequestResult
from pagedserve.entrypoints.bench.serve_dataset import sample_requests
from pagedserve.entrypoints.bench.serve_metrics import parse_percentiles, summarize
from pagedserve.entrypoints.bench.serve_run import arrival_gaps
from tests.entrypoints.openai.server_utils import REPO_ROOT, ServerProcess

NUM_PROMPTS = 8
INPUT_LEN = 6
OUTPUT_LEN = 5


def _bench(server: ServerProcess, out_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "serve",
        "--base-url", server.url, "--num-prompts", str(NUM_PROMPTS),
        "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
        "--result-dir", str(out_dir), "--result-filename", "run.json", *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def test_bench_serve_writes_json_and_png(
    main_server: ServerProcess, tmp_path: Path, figures: dict
) -> None:
    run = _bench(main_server, tmp_path, "--request-rate", "40", "--metric-percentiles", "90,99")
    assert run.returncode == 0, run.stderr
    assert "Serving Benchmark Result" in run.stdout and "P99 TTFT (ms)" in run.stdout
    assert "100%" in run.stderr  # the progress bar
    result = json.loads((tmp_path / "run.json").read_text())
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0
    assert result["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN  # token-id prompts
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN  # ignore_eos
    assert len(result["requests"]) == NUM_PROMPTS
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < result[f"median_{name}_ms"] <= result[f"p99_{name}_ms"]
        assert f"p90_{name}_ms" in result
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    figures[f"bench serve (completions, {NUM_PROMPTS} prompts, rate 40/s)"] = (
        f"{result['output_throughput']:.0f} output tok/s, median TTFT "
        f"{result['median_ttft_ms']:.0f} ms, median TPOT {result['median_tpot_ms']:.0f} ms"
    )


def test_bench_serve_chat_with_max_concurrency(main_server: ServerProcess, tmp_path: Path) -> None:
    run = _bench(
        main_server, tmp_path, "--endpoint", "chat", "--max-concurrency", "3",
        "--range-ratio", "0.4", "--disable-tqdm",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    result = json.loads((tmp_path / "run.json").read_text())
    assert result["completed"] == NUM_PROMPTS and result["prompt_kind"] == "text"
    outputs = [r["output_len"] for r in result["requests"]]
    low, high = math.floor(OUTPUT_LEN * 0.6), math.ceil(OUTPUT_LEN * 1.4)
    assert all(low <= n <= high for n in outputs), outputs
    assert (tmp_path / "run.png").is_file()


def test_bench_serve_unreachable_server_is_one_line(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "serve",
        "--base-url", "http://127.0.0.1:9", "--result-dir", str(tmp_path),
    ]  # fmt: skip
    run = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    last_line = run.stderr.strip().splitlines()[-1]
    assert last_line.startswith("pagedserve bench: error: base_url: cannot reach"), last_line


def test_poisson_gaps() -> None:
    gaps = list(arrival_gaps(4000, 20.0, seed=0))
    assert abs(np.mean(gaps) - 1 / 20.0) < 0.005
    assert abs(np.std(gaps) - 1 / 20.0) < 0.005  # exponential: std = mean
    assert set(arrival_gaps(5, math.inf, seed=0)) == {0.0}
    with pytest.raises(ValueError, match="request_rate"):
        list(arrival_gaps(1, 0.0, seed=0))


def test_sample_lengths() -> None:
    def tokenize(text: str) -> list[int]:
        return [ord(c) for c in text]

    samples = sample_requests(200, 20, 10, 0.5, "token-ids", 0, tokenize, lambda ids: "")
    assert {len(s.prompt) for s in samples} == {s.prompt_len for s in samples}
    assert min(s.prompt_len for s in samples) == 10 and max(s.prompt_len for s in samples) == 30
    assert {s.output_len for s in samples} == set(range(5, 16))
    again = sample_requests(200, 20, 10, 0.5, "token-ids", 0, tokenize, lambda ids: "")
    assert again == samples
    with pytest.raises(ValueError, match="range_ratio"):
        sample_requests(1, 20, 10, 1.5, "token-ids", 0, tokenize, lambda ids: "")


def test_summary_figures() -> None:
    a = RequestResult(
        prompt_len=4, success=True, output_len=3, ttft=0.1, itl=[0.2, 0.4], latency=0.7
    )
    b = RequestResult(prompt_len=6, success=True, output_len=1, ttft=0.3, itl=[], latency=0.3)
    failed = RequestResult(prompt_len=5, error="HTTP 503")
    summary = summarize([a, b, failed], duration=2.0, percentiles=parse_percentiles("50,99"))
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["total_input_tokens"] == 10 and summary["total_output_tokens"] == 4
    assert summary["request_throughput"] == 1.0 and summary["output_throughput"] == 2.0
    assert summary["mean_ttft_ms"] == pytest.approx(200.0)
    assert summary["mean_tpot_ms"] == pytest.approx(300.0)  # (0.7 - 0.1) / 2; b has none
    assert summary["median_itl_ms"] == pytest.approx(300.0)
    assert summary["p50_e2el_ms"] == pytest.approx(500.0)
    with pytest.raises(ValueError, match="metric_percentiles"):
        parse_percentiles("99,abc")
