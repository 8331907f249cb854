"""torch.compile of the model, split at the attention ops: the pieces, and the runner on them.

CUDA graphs cannot be captured on the CPU; here the split graph runs its pieces as they are
(``piece_compiler="eager"``), which checks the splitting, the custom op and the unbacked token
dimension (one trace for every batch size) against the eager model.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from transformers import LlamaForCausalLM

from pagedserve.config import CompilationConfig
from pagedserve.worker.model_runner import ModelRunner
from tests.worker.conftest import TINY_LLAMA, RunnerFactory
from tests.worker.hand_plans import HandScheduler, hf_greedy, random_prompt, run_step

BLOCK_SIZE = 4
# Inductor compiles C++ on the CPU (about a minute here): only "eager" pieces run in CI;
# PAGEDSERVE_TEST_INDUCTOR=1 adds the Inductor-compiled pieces.
PIECE_COMPILERS = ["eager"] + (["inductor"] if os.environ.get("PAGEDSERVE_TEST_INDUCTOR") else [])


def _compiled(runner: ModelRunner, piece_compiler: str) -> ModelRunner:
    """Rebuild ``runner`` with torch.compile on (mode="compile") on the same weights."""
    compilation = CompilationConfig(mode="compile", piece_compiler=piece_compiler)
    runner.config = dataclasses.replace(runner.config, compilation=compilation)
    runner.load_model()
    runner.initialize_kv_cache(runner.num_blocks)
    return runner


@pytest.mark.parametrize("piece_compiler", PIECE_COMPILERS)
def test_compiled_runner_matches_hf_greedy(
    make_runner: RunnerFactory, hf_tiny_llama: LlamaForCausalLM, piece_compiler: str
) -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    runner = _compiled(make_runner(block_size=BLOCK_SIZE), piece_compiler)
    assert runner.compiled_forward is not None
    a, b = random_prompt(11, 1, TINY_LLAMA["vocab_size"]), random_prompt(7, 2, TINY_LLAMA["vocab_size"])
    sched, outputs = HandScheduler(BLOCK_SIZE), {}
    run_step(runner, sched.step(new=[("A", a, 6), ("B", b, 7)]), outputs)  # prefill, 13 tokens
    run_step(runner, sched.step(running=[("A", 5), ("B", 1)]), outputs)  # mixed, 6 tokens
    for _ in range(5):
        run_step(runner, sched.step(running=[("A", 1), ("B", 1)]), outputs)  # decode, 2 tokens
    assert outputs["A"] == hf_greedy(hf_tiny_llama, a, 6)
    assert outputs["B"] == hf_greedy(hf_tiny_llama, b, 7)

    backend = runner.compiled_forward.backend
    layers = TINY_LLAMA["num_hidden_layers"]
    assert backend.num_attention_pieces == layers
    assert backend.num_pieces == 2 * layers + 1
    # One trace served every batch size (13, 6 and 2 tokens padded to capture sizes).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_two_compiled_runners_keep_their_own_backends(make_runner: RunnerFactory) -> None:
    """Dynamo caches per code object: each CompiledForward compiles into its own backend."""
    torch._dynamo.reset()
    first = _compiled(make_runner(block_size=BLOCK_SIZE), "eager")
    second = _compiled(make_runner(block_size=BLOCK_SIZE), "eager")
    sched_a, sched_b, outputs = HandScheduler(BLOCK_SIZE), HandScheduler(BLOCK_SIZE), {}
    prompt = random_prompt(9, 3, TINY_LLAMA["vocab_size"])
    run_step(first, sched_a.step(new=[("A", prompt, 9)]), outputs)
    run_step(second, sched_b.step(new=[("B", prompt, 9)]), outputs)
    assert outputs["A"] == outputs["B"]
    for runner in (first, second):
        assert runner.compiled_forward.backend.num_attention_pieces == TINY_LLAMA["num_hidden_layers"]
