"""One engine start in a fresh process, for the saved-forward tests: no Dynamo state of the
test process can help it. ``python -m tests.compilation.aot_child MODEL_DIR OUT`` builds a
compiled CPU runner on MODEL_DIR, runs three steps and writes OUT (torch.save): each step's
hidden states, the sampled tokens, Dynamo's frame counters and the loaded artifact's path."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tests.compilation.conftest import BLOCK_SIZE, DEEP_LLAMA, _runner
from tests.worker.hand_plans import HandScheduler, random_prompt


def main(model_dir: Path, out: Path) -> None:
    from torch._dynamo.utils import counters

    runner = _runner(model_dir, "compile")
    vocab = DEEP_LLAMA["vocab_size"]
    sched = HandScheduler(BLOCK_SIZE)
    plans = [sched.step(new=[("A", random_prompt(7, 1, vocab), 7),
                             ("B", random_prompt(5, 2, vocab), 5)]),
             sched.step(running=[("A", 1), ("B", 1)]),
             sched.step(running=[("A", 1)])]
    hidden, tokens = [], []
    for plan in plans:
        runner.execute_model(plan)
        hidden.append(runner.execute_model_state.hidden_states.clone())
        tokens.append(runner.sample_tokens().sampled_token_ids)
    forward = runner.compiled_forward
    torch.save({
        "hidden": hidden, "tokens": tokens,
        "frames_traced": int(counters["stats"]["calls_captured"]),
        "aot_artifact": str(forward.aot_artifact) if forward.aot_artifact else None,
        "num_compiles": forward.backend.num_compiles,
    }, out)  # fmt: skip


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
