"""KV-cache sizing (override, CPU byte budget, the cap) and the cache tensors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pagedserve.config import CacheConfig, EngineConfig, ModelConfig
from pagedserve.worker import kv_cache
from pagedserve.worker.model_runner import ModelRunner
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


def test_cpu_default_budget_is_4gib_or_half_of_available(monkeypatch) -> None:
    assert kv_cache.cpu_kv_budget(12345) == 12345
    monkeypatch.setattr(kv_cache, "available_host_bytes", lambda: 64 * 2**30)
    assert kv_cache.cpu_kv_budget(None) == 4 * 2**30
    monkeypatch.setattr(kv_cache, "available_host_bytes", lambda: 6 * 2**30)
    assert kv_cache.cpu_kv_budget(None) == 3 * 2**30


def test_fit_max_model_len_lowers_to_what_one_request_holds(caplog) -> None:
    # 10 blocks: 9 usable of 4 tokens
    assert kv_cache.fit_max_model_len(36, 10 * 100, 100, 4) == 36
    assert not caplog.records
    assert kv_cache.fit_max_model_len(1024, 10 * 100 + 99, 100, 4) == 36
    [warning] = caplog.records
    assert "max_model_len lowered from 1024 to 36" in warning.getMessage()
    assert "--kv-cache-memory" in warning.getMessage()
    with pytest.raises(ValueError, match="^kv_cache_memory: "):
        kv_cache.fit_max_model_len(1024, 150, 100, 4)


def test_runner_context_fits_the_cpu_budget(tiny_llama_dir: Path) -> None:
    """A budget of 10 blocks: the 1024-token context becomes 9 blocks of 4 tokens, and the
    engine's block count holds one such request."""
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
        cache=CacheConfig(block_size=4, kv_cache_memory=10 * BYTES_PER_BLOCK), device="cpu")
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    assert runner.max_model_len == 36
    assert runner.determine_num_blocks() == 10
