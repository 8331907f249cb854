"""benchmarks/spec_decode_bench.py on the CPU: the step arithmetic, the job runner (a stand-in
job script: its figures stream in, a job past its time is killed) and the summaries."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.benchmarks.script_loader import loaded_script


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with loaded_script("spec_decode_bench") as module:
        yield module


def test_expected_tokens_and_break_even(bench: ModuleType) -> None:
    assert bench.expected_tokens(0.8, 2) == pytest.approx(1 + 0.8 + 0.64)
    assert bench.expected_tokens(1.0, 4) == 5
    assert bench.break_even(0.9, 3) == 0.0  # cheaper than a plain step: always pays
    assert bench.break_even(5.0, 4) is None  # even acceptance 1 gives 5 tokens, no more
    a = bench.break_even(1.6, 3)
    assert bench.expected_tokens(a, 3) == pytest.approx(1.6, abs=1e-3)


def test_step_figures(bench: ModuleType) -> None:
    per_k = bench.step_figures(4.0, {2: 5.0}, 1.0)
    e = bench.expected_tokens(0.8, 2)
    assert per_k[2]["ngram_speedup_at_0.8"] == pytest.approx(e * 4 / 5)
    assert per_k[2]["draft_model_speedup_at_0.8"] == pytest.approx(e * 4 / 7)
    assert "draft_model_break_even" not in bench.step_figures(4.0, {2: 5.0}, None)[2]


def test_result_lines(bench: ModuleType) -> None:
    assert bench.parse_result_line('SPEC_RESULT {"job": "plain", "x": 1}\n') == {
        "job": "plain", "x": 1}
    assert bench.parse_result_line("INFO engine ready\n") is None
    assert bench.parse_result_line("SPEC_RESULT {broken\n") is None
    assert bench.parse_result_line("SPEC_RESULT [1]\n") is None


def test_plan_puts_the_batch_64_pair_first(bench: ModuleType) -> None:
    names = [j.name for j in bench.plan_jobs("t", "d", "w")]
    assert names[:2] == ["plain", "spec_k4"]
    assert sorted(names) == sorted(["plain", "draft_step", "draft_model", "tiny"]
                                   + [f"spec_k{k}" for k in range(1, 6)])


def test_run_job_streams_figures_and_kills_a_late_job(bench: ModuleType, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "jobs.py"
    script.write_text("import sys, time\n"
                      "print('SPEC_RESULT {\"job\": \"a\", \"n\": 1}', flush=True)\n"
                      "print('log line', flush=True)\n"
                      "time.sleep(float(sys.argv[1]))\n"
                      "print('SPEC_RESULT {\"job\": \"a\", \"n\": 2}', flush=True)\n")
    monkeypatch.setattr(bench, "JOBS_SCRIPT", script)
    got: list[dict] = []
    assert bench.run_job(bench.Job("a", ["0"], 1), 30, got.append) == 0
    assert [r["n"] for r in got] == [1, 2]
    got.clear()
    assert bench.run_job(bench.Job("a", ["30"], 1), 1, got.append) != 0
    assert [r["n"] for r in got] == [1]  # what came before the kill is kept


def results() -> list[dict]:
    plain_e2e = dict(figure="e2e", job="plain", known_output=True, acceptance=0.0,
                     tokens_per_drafting_step=1.0)
    spec_e2e = dict(figure="e2e", job="spec", known_output=True)
    return [
        {"job": "plain", "figure": "step", "step_ms": 4.0},
        {"job": "draft_step", "figure": "step", "step_ms": 1.0},
        {"job": "spec", "figure": "verify_step", "k": 4, "step_ms": 5.0},
        {**plain_e2e, "workload": "ngram", "decode_tok_per_s": 250.0},
        {**plain_e2e, "workload": "iid", "decode_tok_per_s": 250.0},
        {**spec_e2e, "k": 4, "workload": "ngram", "decode_tok_per_s": 900.0,
         "acceptance": 1.0, "tokens_per_drafting_step": 5.0},
        {**spec_e2e, "k": 4, "workload": "iid", "p": 0.8, "decode_tok_per_s": 450.0,
         "acceptance": 0.59, "tokens_per_drafting_step": 3.3},
        *({"job": "plain", "figure": "b64", "run": i, "tok_per_s": t}
          for i, t in enumerate([100.0, 110.0, 90.0])),
        *({"job": "spec", "figure": "b64", "run": i, "tok_per_s": t, "drafted": 0}
          for i, t in enumerate([99.0, 100.0, 90.0])),
        {"job": "draft_model", "figure": "spec_step", "k": 4, "step_ms": 12.0,
         "verify_only_ms": 6.0},
    ]


def test_summaries(bench: ModuleType) -> None:
    s = bench.summarize(results())
    assert set(s) == {"spec.steps", "spec.e2e", "spec.b64", "spec.draft_model"}
    assert s["spec.steps"]["per_k"][4]["ngram_speedup_at_0.8"] == pytest.approx(
        bench.expected_tokens(0.8, 4) * 4 / 5)
    ngram = s["spec.e2e"]["ngram"][4]
    assert ngram["speedup"] == pytest.approx(3.6)
    assert ngram["predicted_speedup"] == pytest.approx(5 * 4 / 5)
    assert s["spec.e2e"]["ngram_meets_2x"] and not s["spec.e2e"]["iid_meets_2x"]
    assert s["spec.b64"]["ratios"] == pytest.approx([0.99, 100 / 110, 1.0])
    assert s["spec.b64"]["throughput_ratio"] == pytest.approx(0.99)
    assert s["spec.b64"]["meets_0.97"]
    draft = s["spec.draft_model"]["per_k"][4]
    assert draft["draft_ms"] == 6.0
    assert draft["speedup_at_0.8_with_k_verify_graph"] == pytest.approx(
        bench.expected_tokens(0.8, 4) * 4 / 11)


def test_summaries_skip_what_is_missing(bench: ModuleType) -> None:
    only_plain = [r for r in results() if r["job"] == "plain"]
    assert set(bench.summarize(only_plain)) == {"spec.e2e"}
    assert bench.summarize([]) == {}
