"""The CPU engine's start-up makes the panel copies (``CpuPlatform.prepare_weights``) that the C
decode step and the LM head multiply on from ``PANEL_MIN_ROWS`` requests on: no request waits
for them, and the tokens are those of copies made on first use."""

from __future__ import annotations

import random

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.layers.panel_pack import PANEL_MIN_ROWS, panel_copies
from pagedserve.model.cpu_decode import CpuDecodeForward, _panel_weights
from pagedserve.platform.cpu import CpuPlatform

ENGINE = dict(dtype="float32", max_num_batched_tokens=128, num_gpu_blocks_override=64,
              max_num_seqs=8, skip_tokenizer_init=True)
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _prompts(vocab_size: int) -> list[dict[str, list[int]]]:
    """PANEL_MIN_ROWS + 1 prompts: their decode steps multiply on panels."""
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(3, vocab_size) for _ in range(rng.randint(5, 30))]}
            for _ in range(PANEL_MIN_ROWS + 1)]


def _tokens(llm: LLM, prompts: list[dict[str, list[int]]]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def _never(weight: torch.Tensor) -> torch.Tensor:
    raise AssertionError("a step made a panel copy: start-up should have made it")


def test_start_up_makes_the_panels_and_the_tokens_stay(checkpoints, monkeypatch) -> None:
    folder, hf_model, _ = checkpoints("llama")
    prompts = _prompts(hf_model.config.vocab_size)
    with monkeypatch.context() as on_use:  # the copies made in the first step of 3 rows
        on_use.setattr(CpuPlatform, "prepare_weights", lambda *_: None)
        expected = _tokens(LLM(str(folder), **ENGINE), prompts)

    llm = LLM(str(folder), **ENGINE)
    runner = llm.engine_core.model_runner
    step = runner.forward_fn
    assert isinstance(step, CpuDecodeForward)  # the C step serves this model
    model = runner.model
    weights = [w for layer in model.model.layers for w in _panel_weights(layer)]
    assert all(panel_copies().has(w) for w in [*weights, model.lm_head.weight])

    monkeypatch.setattr(panel_copies(), "make", _never)
    assert _tokens(llm, prompts) == expected
    assert step.c_steps > 0 and step._panels is not None
    assert all(p is not None for layer in step._panels for p in layer)


def test_an_engine_of_fewer_requests_makes_none(checkpoints) -> None:
    folder, _, _ = checkpoints("llama")
    llm = LLM(str(folder), **{**ENGINE, "max_num_seqs": PANEL_MIN_ROWS - 1})
    model = llm.engine_core.model_runner.model
    assert not any(panel_copies().has(w) for w in _panel_weights(model.model.layers[0]))

