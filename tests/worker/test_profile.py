"""The memory profile: the largest step and its plan, the CUDA budget's terms, and how the
profiler assembles its measurements (torch.cuda's figures scripted, so it runs on the CPU)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from pagedserve.compilation.phase_log import KV_BUDGET_FIELD
from pagedserve.worker import profile
from pagedserve.worker.profile import (
    PROFILE_SAMPLING,
    MemoryProfile,
    MemoryProfiler,
    profile_step,
)
from tests.worker.conftest import RunnerFactory


def test_profile_step_fills_the_token_budget() -> None:
    step = profile_step(max_num_batched_tokens=100, max_num_seqs=8, max_model_len=64,
                        block_size=16)
    lens = [len(r.prefill_token_ids) for r in step.run.scheduled_new_reqs]
    assert lens == [13, 13, 13, 13, 12, 12, 12, 12] and step.run.total_num_scheduled_tokens == 100
    block_ids = [b for r in step.run.scheduled_new_reqs for b in r.block_ids[0]]
    assert block_ids == list(range(1, 9)) and step.num_blocks == 9
    assert step.finish.finished_req_ids == set(step.run.num_scheduled_tokens)
    # Fewer slots than the budget needs: every request runs its whole context.
    small = profile_step(max_num_batched_tokens=100, max_num_seqs=2, max_model_len=30,
                         block_size=16)
    assert small.run.num_scheduled_tokens == {"profile-0": 30, "profile-1": 30}


def test_profile_step_runs_through_the_runner(make_runner: RunnerFactory) -> None:
    runner = make_runner(block_size=4, max_num_seqs=4, max_num_batched_tokens=24, num_blocks=16)
    step = profile_step(24, 4, runner.max_model_len, 4)
    assert step.num_blocks <= 16
    runner.execute_model(step.run)
    output = runner.sample_tokens()
    assert [len(t) for t in output.sampled_token_ids] == [1, 1, 1, 1]
    assert all(len(lp.token_ids[0]) == PROFILE_SAMPLING.logprobs + 1
               for lp in output.logprobs.values())
    runner.execute_model(step.finish)
    assert runner.states.req_id_to_index == {}


# ---- the CUDA budget: MemoryProfile arithmetic and the profiler's assembly ------------------

GIB = 2**30


def test_budget_subtracts_what_the_engine_holds_activations_and_graphs() -> None:
    """Memory in use before the engine (the CUDA context, another engine) is not its own."""
    profile = MemoryProfile(total=140 * GIB, baseline=GIB, in_use=18 * GIB,
                                     weights=15 * GIB, activations=4 * GIB, graphs=GIB // 2)
    assert profile.engine == 17 * GIB
    assert profile.kv_budget(0.9) == int(0.9 * 140 * GIB) - 17 * GIB - 4 * GIB - GIB // 2
    assert profile.kv_budget(0.1) < 0  # num_blocks_from_budget turns this into a clear error


def test_budget_terms_are_logged_as_figures(caplog: pytest.LogCaptureFixture) -> None:
    profile = MemoryProfile(total=100, baseline=10, in_use=40, weights=20,
                                     activations=5, graphs=7)
    with caplog.at_level(logging.INFO, logger="pagedserve.worker.profile"):
        assert profile.log_kv_budget(0.5) == 50 - 30 - 5 - 7
    (record,) = [r for r in caplog.records if hasattr(r, KV_BUDGET_FIELD)]
    figures = getattr(record, KV_BUDGET_FIELD)
    assert figures["graphs"] == 7 and figures["baseline"] == 10 and figures["budget"] == 8
    assert "CUDA graphs" in record.getMessage()


def test_memory_profile_refuses_impossible_figures() -> None:
    with pytest.raises(ValueError, match="MemoryProfile.graphs"):
        MemoryProfile(total=100, baseline=0, in_use=30, weights=20, activations=5,
                               graphs=-1)
    with pytest.raises(ValueError, match="MemoryProfile.in_use: 130 exceeds"):
        MemoryProfile(total=100, baseline=0, in_use=130, weights=20, activations=5,
                               graphs=0)


def test_engine_holds_at_least_its_weights() -> None:
    """Another process freed memory after the baseline: in_use - baseline undercounts."""
    profile = MemoryProfile(total=100, baseline=40, in_use=30, weights=20,
                                     activations=5, graphs=0)
    assert profile.engine == 20 and profile.kv_budget(0.9) == 90 - 20 - 5


class _FakeCuda:
    """Scripted torch.cuda memory figures: 5000 bytes in use of 100000, a step reserving 600
    bytes above its base of 1000."""

    total, in_use, base, peak = 100_000, 5_000, 1_000, 1_600

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
            monkeypatch.setattr(torch.cuda, name, lambda *a: None)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: self.base)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: self.peak)
        monkeypatch.setattr(torch.cuda, "mem_get_info",
                            lambda *a: (self.total - self.in_use, self.total))


def test_profiler_assembles_the_measurements(
    make_runner: RunnerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The profile step runs twice with a fresh compile (compile, then the measured run); the
    graphs are captured on a temporary cache of the step's blocks, released afterwards."""
    runner = make_runner(block_size=4, max_num_seqs=4, max_num_batched_tokens=24)
    _FakeCuda().install(monkeypatch)
    steps, captured_with = [], []
    real_run = profile.run_profile_step
    monkeypatch.setattr(profile, "run_profile_step",
                        lambda r, step: (steps.append(step), real_run(r, step)))
    forward = SimpleNamespace(compile_stats=None)

    def capture_before_kv_cache(r, f, num_blocks):  # noqa: ANN001, ANN202
        assert (r, f, num_blocks) == (runner, forward, step.num_blocks)
        captured_with.append(dict(r.kv_caches))
        return 700

    graphs = SimpleNamespace(enabled=True, capture_before_kv_cache=capture_before_kv_cache)
    step = profile_step(24, 4, runner.max_model_len, 4)
    profiler = MemoryProfiler(torch.device("cpu"), step, baseline=1_000, weights=300)
    result = profiler.measure(runner, forward, graphs)
    assert result == MemoryProfile(total=100_000, baseline=1_000, in_use=5_000, weights=300,
                                   activations=600, graphs=700)
    assert steps == [step, step] and len(captured_with) == 1
    assert captured_with[0] and all(t.shape[1] == step.num_blocks
                                    for t in captured_with[0].values())
    assert runner.kv_caches == {}  # every temporary cache released


def test_profiler_without_graphs_or_compile_runs_the_step_once(
    make_runner: RunnerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = make_runner(block_size=4, max_num_seqs=4, max_num_batched_tokens=24)
    _FakeCuda().install(monkeypatch)
    steps = []
    real_run = profile.run_profile_step
    monkeypatch.setattr(profile, "run_profile_step",
                        lambda r, step: (steps.append(step), real_run(r, step)))
    graphs = SimpleNamespace(enabled=False)
    step = profile_step(24, 4, runner.max_model_len, 4)
    result = MemoryProfiler(torch.device("cpu"), step, 0, 0).measure(runner, None, graphs)
    assert (result.activations, result.graphs, len(steps)) == (600, 0, 1)
    assert runner.kv_caches == {}
