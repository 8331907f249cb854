"""One compile for every batch size, identical pieces compiled once, no second trace.

CPU runs with ``piece_compiler="eager"`` (the traced FX pieces): the structure under test (the
split, the piece sharing, the guard-free single trace) is the same as with Inductor.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pagedserve.worker.model_runner import ModelRunner
from tests.compilation.conftest import BLOCK_SIZE, DEEP_LLAMA
from tests.worker.hand_plans import HandScheduler, random_prompt, run_step

Factory = Callable[[str], ModelRunner]


def _generate(runner: ModelRunner) -> dict[str, list[int]]:
    """Steps of 9, 6, 2 and 1 tokens: prefill, mixed, decode, a lone decode."""
    vocab = DEEP_LLAMA["vocab_size"]
    a, b = random_prompt(7, 1, vocab), random_prompt(5, 2, vocab)
    sched, outputs = HandScheduler(BLOCK_SIZE), {}
    run_step(runner, sched.step(new=[("A", a, 4), ("B", b, 5)]), outputs)
    run_step(runner, sched.step(running=[("A", 3), ("B", 1)]), outputs)
    for _ in range(3):
        run_step(runner, sched.step(running=[("A", 1), ("B", 1)]), outputs)
    for _ in range(2):
        run_step(runner, sched.step(running=[("A", 1)]), outputs)
    return outputs


def test_one_compile_serves_every_size_and_matches_eager(deep_runner: Factory) -> None:
    torch._dynamo.reset()
    compiled = deep_runner("compile")
    got = _generate(compiled)
    assert got == _generate(deep_runner("none"))
    forward = compiled.compiled_forward
    backend = forward.backend
    assert backend.num_compiles == 1
    layers = DEEP_LLAMA["num_hidden_layers"]
    assert backend.num_pieces == 2 * layers + 1
    # first piece (embedding + layer 0), one shared middle piece, last piece (final norm)
    assert backend.num_distinct_pieces == 3
    stats = forward.compile_stats
    assert stats is not None and stats.num_distinct_pieces == 3 and stats.seconds > 0
    assert stats.cache_dir is None  # eager pieces: no Inductor cache involved


def test_shared_piece_is_called_with_each_pieces_own_weights(deep_runner: Factory) -> None:
    """Zeroing one middle layer's MLP changes the output: the shared callable reads the
    weights it is given, not the first piece's."""
    torch._dynamo.reset()
    unchanged = _generate(deep_runner("none"))
    compiled, eager = deep_runner("compile"), deep_runner("none")
    for runner in (compiled, eager):
        with torch.no_grad():
            runner.model.model.layers[2].mlp.down_proj.weight.zero_()
    changed = _generate(eager)
    assert changed != unchanged
    assert _generate(compiled) == changed


def test_a_second_trace_is_refused(deep_runner: Factory) -> None:
    torch._dynamo.reset()
    runner = deep_runner("compile")
    _generate(runner)
    torch._dynamo.reset()  # forgets the compiled code: the next call would trace again
    sched = HandScheduler(BLOCK_SIZE)
    with pytest.raises(Exception, match="traced a second time"):
        run_step(runner, sched.step(new=[("C", [1, 2, 3], 3)]), {})
