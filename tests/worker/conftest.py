"""Fixtures of the runner tests: a tiny random Llama checkpoint and runners built on it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedserve.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from pagedserve.worker.model_runner import ModelRunner

TINY_LLAMA = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.1,  # wide logits: no near-ties for greedy decoding to trip on
    bos_token_id=None,
    eos_token_id=None,  # generation never stops early
    pad_token_id=None,
)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).to(torch.float32).eval()
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_tiny_llama(tiny_llama_dir: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


RunnerFactory = Callable[..., ModelRunner]


def build_runner(
    model_dir: Path,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    block_size: int = 4,
    num_blocks: int = 64,
    max_capture_size: int = 512,
    piecewise_capture_sizes: tuple[int, ...] | None = None,
    speculative_config: dict | None = None,
) -> ModelRunner:
    """A loaded CPU runner (fp32) with a KV cache of ``num_blocks`` blocks; PIECEWISE pads on
    ``piecewise_capture_sizes`` where given (else the sparse default ladder)."""
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32"),
        cache=CacheConfig(block_size=block_size, num_gpu_blocks_override=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  speculative_config=speculative_config),
        compilation=CompilationConfig(
            max_capture_size=max_capture_size,
            piecewise_cudagraph_capture_sizes=piecewise_capture_sizes,
        ),
        device="cpu",
    )
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_blocks())
    return runner


@pytest.fixture
def make_runner(tiny_llama_dir: Path) -> RunnerFactory:
    """``make_runner(max_num_seqs=..., num_blocks=...)``: build_runner on the tiny Llama."""
    return functools.partial(build_runner, tiny_llama_dir)
