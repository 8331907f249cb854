"""KV-cache sizing (override, CPU byte budget, the cap, the CUDA budget's terms), the profile
step and its plan, and how profile_memory assembles its measurements."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch

from pagedserve.compilation.phase_log import KV_BUDGET_FIELD
from pagedserve.config import CacheConfig
from pagedserve.worker import kv_cache, profile
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.profile import PROFILE_SAMPLING, profile_step
from tests.worker.conftest import TINY_LLAMA, RunnerFactory

# 2 layers x (K and V) x 4 tokens x 2 KV heads x head_dim 8 x 4 bytes (fp32)
BYTES_PER_BLOCK = 2 * 2 * 4 * 2 * 8 * 4


def _with_cache(runner: ModelRunner, **cache: object) -> ModelRunner:
    runner.config = dataclasses.replace(runner.config, cache=CacheConfig(block_size=4, **cache))
    return runner


def test_bytes_per_block_counts_every_layer(make_runner: RunnerFactory) -> None:
    runner = make_runner(block_size=4)
    assert TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"] == 8
    assert kv_cache.kv_bytes_per_block(runner.attn_layers, 4, runner.dtype) == BYTES_PER_BLOCK


def test_num_blocks_from_override_budget_and_cap(make_runner: RunnerFactory) -> None:
    runner = make_runner(block_size=4, max_num_seqs=8)
    assert _with_cache(runner, num_gpu_blocks_override=7).determine_num_blocks() == 7
    budget = 10 * BYTES_PER_BLOCK + 5
    assert _with_cache(runner, kv_cache_memory=budget).determine_num_blocks() == 10
    # 8 requests of max_model_len 1024 use at most 8 * 256 blocks, plus the null block.
    huge = _with_cache(runner, kv_cache_memory=2**30).determine_num_blocks()
    assert huge == 8 * (1024 // 4) + 1
    with pytest.raises(ValueError, match="KV cache"):
        _with_cache(runner, kv_cache_memory=BYTES_PER_BLOCK).determine_num_blocks()


def test_initialize_kv_cache_binds_every_layer(make_runner: RunnerFactory) -> None:
    runner = make_runner(block_size=4, num_blocks=12)
    for name, layer in runner.attn_layers.items():
        assert layer.kv_cache is runner.kv_caches[name]
        assert layer.kv_cache.shape == (2, 12, 4, 2, 8)
        assert layer.backend is runner.attn_backend


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


# ---- the CUDA budget: MemoryProfile arithmetic and profile_memory's assembly -----------------

GIB = 2**30


def test_budget_subtracts_what_the_engine_holds_activations_and_graphs() -> None:
    """Memory in use before the engine (the CUDA context, another engine) is not its own."""
    profile = kv_cache.MemoryProfile(total=140 * GIB, baseline=GIB, in_use=18 * GIB,
                                     weights=15 * GIB, activations=4 * GIB, graphs=GIB // 2)
    assert profile.engine == 17 * GIB
    assert profile.kv_budget(0.9) == int(0.9 * 140 * GIB) - 17 * GIB - 4 * GIB - GIB // 2
    assert profile.kv_budget(0.1) < 0  # num_blocks_from_budget turns this into a clear error


def test_budget_terms_are_logged_as_figures(caplog: pytest.LogCaptureFixture) -> None:
    profile = kv_cache.MemoryProfile(total=100, baseline=10, in_use=40, weights=20,
                                     activations=5, graphs=7)
    with caplog.at_level(logging.INFO, logger="pagedserve.worker.kv_cache"):
        assert kv_cache.cuda_kv_budget(profile, 0.5) == 50 - 30 - 5 - 7
    (record,) = [r for r in caplog.records if hasattr(r, KV_BUDGET_FIELD)]
    figures = getattr(record, KV_BUDGET_FIELD)
    assert figures["graphs"] == 7 and figures["baseline"] == 10 and figures["budget"] == 8
    assert "CUDA graphs" in record.getMessage()


def test_memory_profile_refuses_impossible_figures() -> None:
    with pytest.raises(ValueError, match="MemoryProfile.graphs"):
        kv_cache.MemoryProfile(total=100, baseline=0, in_use=30, weights=20, activations=5,
                               graphs=-1)
    with pytest.raises(ValueError, match="MemoryProfile.in_use: 130 exceeds"):
        kv_cache.MemoryProfile(total=100, baseline=0, in_use=130, weights=20, activations=5,
                               graphs=0)


def test_engine_holds_at_least_its_weights() -> None:
    """Another process freed memory after the baseline: in_use - baseline undercounts."""
    profile = kv_cache.MemoryProfile(total=100, baseline=40, in_use=30, weights=20,
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


def test_profile_memory_assembles_the_measurements(
    make_runner: RunnerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The profile step runs twice with a fresh compile (compile, then the measured run); the
    graphs are captured on a temporary cache that is released afterwards."""
    runner = make_runner(block_size=4, max_num_seqs=4, max_num_batched_tokens=24)
    _FakeCuda().install(monkeypatch)
    runner.compiled_forward = SimpleNamespace(compile_stats=None, graph_pool=object())
    steps, captured_with = [], []
    real_run = profile.run_profile_step
    monkeypatch.setattr(profile, "run_profile_step",
                        lambda r, step: (steps.append(step), real_run(r, step)))
    monkeypatch.setattr(profile, "capture_before_kv_cache",
                        lambda r: (captured_with.append(dict(r.kv_caches)), 700)[1])
    runner.memory_baseline = 1_000
    result = profile.profile_memory(runner)
    assert result == kv_cache.MemoryProfile(total=100_000, baseline=1_000, in_use=5_000,
                                            weights=runner.weights_bytes, activations=600,
                                            graphs=700)
    assert len(steps) == 2 and len(captured_with) == 1 and captured_with[0]
    assert runner.kv_caches == {}  # every temporary cache released
