"""``LLM.generate(..., priority=[...])``: lower first under the priority policy, refused
under fcfs (where it would be ignored)."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from tests.engine.tiny_models import save_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def _llm(folder: str, policy: str) -> LLM:
    return LLM(model=folder, dtype="float32", max_model_len=64, num_gpu_blocks_override=32,
               max_num_seqs=1, block_size=16, policy=policy, seed=0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    path, _, _ = save_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))
    return str(path)


def test_lower_priority_value_is_admitted_first(folder: str) -> None:
    llm = _llm(folder, "priority")
    prompts = ["first to arrive", "second", "third"]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, priority=[5, 0, 3])
    assert [o.prompt for o in outputs] == prompts  # input order kept
    # One sequence at a time: each request's first token comes after the previous one ends.
    first_token = {o.prompt: o.metrics.first_token_time for o in outputs}
    assert first_token["second"] < first_token["third"] < first_token["first to arrive"]
    # Without priorities the arrival order holds.
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    times = [o.metrics.first_token_time for o in outputs]
    assert times == sorted(times)


def test_priority_refused_under_fcfs_and_bad_lengths(folder: str) -> None:
    llm = _llm(folder, "fcfs")
    with pytest.raises(ValueError, match=r"^priority: needs --policy priority"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[0, 1])
    assert len(llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[0, 0])) == 2
    with pytest.raises(ValueError, match=r"^priority: expected 2 values"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[0])
    with pytest.raises(ValueError, match=r"^priority: expected an integer"):
        llm.generate(["a"], GREEDY, use_tqdm=False, priority=[1.5])  # type: ignore[list-item]
