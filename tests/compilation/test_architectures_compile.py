"""Every supported architecture traces under torch.compile with an unbacked token dimension
(one trace for all batch sizes) and gives the eager model's greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.model.hf_tiny import CASES, make_hf_model

PROMPTS = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 23, 1, 40)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _greedy(folder: Path, **kwargs) -> list[list[int]]:  # noqa: ANN003
    llm = LLM(str(folder), dtype="float32", skip_tokenizer_init=True, max_num_seqs=4,
              num_gpu_blocks_override=64, **kwargs)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_pieces_match_eager(case: str, tmp_path: Path) -> None:
    torch._dynamo.reset()
    make_hf_model(case).save_pretrained(tmp_path)
    eager = _greedy(tmp_path, mode="none")
    compiled = _greedy(tmp_path, mode="compile", piece_compiler="eager")
    assert compiled == eager
