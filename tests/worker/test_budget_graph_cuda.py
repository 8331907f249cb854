"""The budget-step graph on CUDA: a step that fills the token budget replays its PIECEWISE graph
(captured as several prompts where the budget exceeds the context), other steps above the
ladder run eagerly, and the tokens equal an eager engine's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.worker.capture_sizes import CudaGraphMode
from tests.worker.conftest import TINY_LLAMA

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BUDGET = 256
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _llm(model_dir: Path, **kwargs) -> LLM:  # noqa: ANN003
    return LLM(model=str(model_dir), dtype="float32", max_model_len=128, max_num_seqs=8,
               max_num_batched_tokens=BUDGET, gpu_memory_utilization=0.2,
               enable_prefix_caching=False, skip_tokenizer_init=True, **kwargs)


def test_a_full_budget_step_replays_the_budget_graph(tiny_llama_dir: Path) -> None:
    llm = _llm(tiny_llama_dir, max_capture_size=64, budget_step_graph=True)
    runner = llm.engine_core.model_runner
    assert BUDGET in runner.graphs.captured[CudaGraphMode.PIECEWISE]  # 2 prompts of 128
    modes: list[tuple[int, CudaGraphMode]] = []
    dispatch = runner.graphs.dispatch

    def spy(plan):  # noqa: ANN001, ANN202
        descriptor, mode = dispatch(plan)
        modes.append((descriptor.num_tokens, mode))
        return descriptor, mode

    runner.graphs.dispatch = spy
    generator = torch.Generator().manual_seed(0)
    vocab = TINY_LLAMA["vocab_size"]
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (100, 100, 56)]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert modes[0] == (BUDGET, CudaGraphMode.PIECEWISE)  # 256 prompt tokens: the budget graph
    shorter = llm.generate(prompts[:2], GREEDY, use_tqdm=False)  # 200 tokens: eager, unpadded
    assert (200, CudaGraphMode.NONE) in modes
    eager = _llm(tiny_llama_dir, enforce_eager=True)
    expected = eager.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert [o.outputs[0].token_ids for o in shorter] == [o.outputs[0].token_ids
                                                         for o in expected[:2]]


def test_unset_the_option_follows_the_model_size(tiny_llama_dir: Path) -> None:
    default = _llm(tiny_llama_dir, max_capture_size=64).engine_core.model_runner
    assert BUDGET in default.graphs.captured[CudaGraphMode.PIECEWISE]  # a tiny model: captured
    off = _llm(tiny_llama_dir, max_capture_size=64, budget_step_graph=False)
    assert BUDGET not in off.engine_core.model_runner.graphs.captured[CudaGraphMode.PIECEWISE]
