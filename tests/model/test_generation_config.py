"""``generation_config.json`` supplies default sampling values; request fields win."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.model.generation_config import default_sampling_values
from tests.engine.tiny_models import save_checkpoint


def write_generation_config(folder: Path, **values: object) -> None:
    (folder / "generation_config.json").write_text(json.dumps(values))


def test_values_read_and_mapped(tmp_path: Path) -> None:
    write_generation_config(tmp_path, temperature=0.6, top_p=0.9, top_k=20, do_sample=True,
                            max_new_tokens=7, eos_token_id=[1, 2], min_p=None)
    want = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 7}
    assert default_sampling_values("auto", tmp_path) == want
    assert default_sampling_values(str(tmp_path), tmp_path / "elsewhere") == want
    assert default_sampling_values("vllm", tmp_path) == {}
    assert default_sampling_values("auto", tmp_path / "none") == {}


def test_named_folder_without_file_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^generation_config: .* does not exist"):
        default_sampling_values(str(tmp_path), tmp_path)


@pytest.fixture(scope="module")
def greedy_by_default(tmp_path_factory) -> Path:
    folder, _, _ = save_checkpoint("llama", tmp_path_factory.mktemp("gen"))
    write_generation_config(folder, temperature=0.0, max_new_tokens=5)
    return folder


def test_llm_defaults_come_from_the_file(greedy_by_default: Path, tmp_path: Path) -> None:
    llm = LLM(model=str(greedy_by_default), dtype="float32")
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
    [out] = llm.generate("Hello world", use_tqdm=False)
    [want] = llm.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=5),
                          use_tqdm=False)
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    assert len(out.outputs[0].token_ids) <= 5
    # a request's own params win: the file's max_new_tokens does not cap them
    [longer] = llm.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=9,
                                                          ignore_eos=True), use_tqdm=False)
    assert len(longer.outputs[0].token_ids) == 9


def test_llm_generation_config_vllm_ignores_the_file(greedy_by_default: Path,
                                                     tmp_path: Path) -> None:
    folder = tmp_path / "copy"
    shutil.copytree(greedy_by_default, folder)
    llm = LLM(model=str(folder), dtype="float32", generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()
