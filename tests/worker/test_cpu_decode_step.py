"""The CPU runner's decode steps in C (``model/cpu_decode.py``): chosen by default on the CPU,
serving exactly the steps whose requests each decode one token, with the torch layers' tokens
(and transformers'); ``one_token_step="compiled"`` turns it off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from pagedserve.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from pagedserve.model.cpu_decode import CpuDecodeForward, load_decode_step
from pagedserve.worker.model_runner import ModelRunner
from tests.worker.hand_plans import HandScheduler, hf_greedy, random_prompt, run_step

pytestmark = pytest.mark.skipif(load_decode_step() is None, reason="no C compiler here")
BLOCK_SIZE = 4


def _runner(model_dir: Path, one_token_step: str) -> ModelRunner:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32"),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=64),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
        compilation=CompilationConfig(one_token_step=one_token_step),  # type: ignore[arg-type]
        device="cpu",
    )
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(64)
    return runner


def _generate(runner: ModelRunner, a: list[int], b: list[int]) -> dict[str, list[int]]:
    """A prefill, a mixed step, three decode steps of both requests, two of A alone."""
    sched, outputs = HandScheduler(BLOCK_SIZE), {}
    run_step(runner, sched.step(new=[("A", a, len(a)), ("B", b, 2)]), outputs)
    run_step(runner, sched.step(running=[("A", 1), ("B", len(b) - 2)]), outputs)
    for _ in range(3):
        run_step(runner, sched.step(running=[("A", 1), ("B", 1)]), outputs)
    for _ in range(2):
        run_step(runner, sched.step(running=[("A", 1)]), outputs)
    return outputs


def test_decode_steps_run_in_c_with_the_torch_layers_tokens(
    tiny_llama_dir: Path, hf_tiny_llama: LlamaForCausalLM
) -> None:
    torch.set_num_threads(1)
    vocab = hf_tiny_llama.config.vocab_size
    a, b = random_prompt(9, 1, vocab), random_prompt(6, 2, vocab)
    fused, torch_layers = _runner(tiny_llama_dir, "gemv"), _runner(tiny_llama_dir, "compiled")
    assert isinstance(fused.forward_fn, CpuDecodeForward)
    assert not isinstance(torch_layers.forward_fn, CpuDecodeForward)
    got = _generate(fused, a, b)
    assert got == _generate(torch_layers, a, b)
    assert fused.forward_fn.c_steps == 3 + 2  # the prefill and the mixed step: torch layers
    assert got["A"] == hf_greedy(hf_tiny_llama, a, len(got["A"]))
    assert got["B"] == hf_greedy(hf_tiny_llama, b, len(got["B"]))
