"""benchmarks/spec_decode_jobs.py on the CPU, on the suite's tiny random Llama: the known
output (every greedy token is the known one, on the plain and the speculative engine), the
workloads' acceptance (ngram ~1, the iid proposer's rate p per position)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from pagedserve import LLM
from pagedserve.spec_decode.proposer import DraftRequest
from tests.benchmarks.script_loader import loaded_script


@pytest.fixture(scope="module")
def jobs() -> Iterator[ModuleType]:
    with loaded_script("spec_decode_jobs") as module:
        yield module


@pytest.fixture(scope="module")
def tiny(jobs: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The suite's tiny model and its engine options, on the CPU."""
    _, common = jobs.tiny_workload(tmp_path_factory.mktemp("tiny"))
    return {**common, "device": "cpu"}


def test_iid_drafts_are_right_at_rate_p(jobs: ModuleType) -> None:
    proposer = jobs.IidDrafts(token=7, p=0.8, seed=1)
    drafts = proposer.propose([DraftRequest(str(i), [1, 2], 5) for i in range(2000)])
    flat = np.array(drafts)  # [2000, 5]
    assert flat.shape == (2000, 5) and set(np.unique(flat)) <= {7, 8}
    assert (flat == 7).mean() == pytest.approx(0.8, abs=0.02)


def test_prompts(jobs: ModuleType) -> None:
    p = jobs.prompts(512)
    assert len(p["ngram"]) == len(p["iid"]) == jobs.PROMPT_LEN
    assert p["ngram"][-jobs.RUN_LEN:] == [jobs.KNOWN_TOKEN] * jobs.RUN_LEN
    assert jobs.KNOWN_TOKEN not in p["ngram"][: -jobs.RUN_LEN] + p["iid"]


def test_known_output_without_speculation(jobs: ModuleType, tiny: dict,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobs, "E2E_TOKENS", 24)
    llm = LLM(**tiny)
    result = jobs.e2e(llm, jobs.prompts(512)["iid"])
    assert result["known_output"] and result["drafted"] == 0
    assert result["decode_tok_per_s"] > 0


def test_known_output_with_ngram_and_iid_drafts(jobs: ModuleType, tiny: dict,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """ngram on the repetitive prompt: every draft accepted; the iid proposer at p = 0.8:
    runs cut at the first wrong draft (k = 3: mean accepted 0.8 + 0.64 + 0.512 of 3)."""
    monkeypatch.setattr(jobs, "E2E_TOKENS", 150)
    llm = LLM(**tiny, speculative_config=jobs.spec_config(3))
    workloads = jobs.prompts(512)
    ngram = jobs.e2e(llm, workloads["ngram"])
    assert ngram["known_output"] and ngram["drafted"] > 0
    assert ngram["acceptance"] == 1.0
    llm.engine_core.scheduler.proposer = jobs.IidDrafts(jobs.KNOWN_TOKEN, 0.8)
    iid = jobs.e2e(llm, workloads["iid"])
    assert iid["known_output"]
    assert iid["acceptance"] == pytest.approx((0.8 + 0.64 + 0.512) / 3, abs=0.15)


def test_spec_config(jobs: ModuleType) -> None:
    import json

    assert json.loads(jobs.spec_config(4, gate=True)) == {
        "method": "ngram", "num_speculative_tokens": 4}
    assert json.loads(jobs.spec_config(5, draft="d"))["min_acceptance_rate"] == 0.0
    assert Path(jobs.__file__).name == "spec_decode_jobs.py"
