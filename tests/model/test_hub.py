"""Hub names (``org/name``) resolve through a Hugging Face cache laid out on disk, offline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.config import ModelConfig
from pagedserve.model.hub import is_repo_id
from pagedserve.model.resolve import model_folder, resolve_model
from pagedserve.model.tokenizer import get_tokenizer
from tests.engine.tiny_models import save_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[2]


def add_to_hub_cache(cache: Path, repo_id: str, folder: Path, commit: str,
                     refs: tuple[str, ...] = ("main",)) -> Path:
    """Lay ``folder``'s files out as ``huggingface_hub`` caches a download: a snapshot folder
    per commit and one file per ref naming the commit. Returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(folder, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    folder, _, _ = save_checkpoint("llama", tmp_path_factory.mktemp("tiny"))
    return folder


@pytest.mark.parametrize(("name", "expected"), [
    ("meta-llama/Llama-3.1-8B-Instruct", True), ("Qwen/Qwen3-0.6B", True), ("org/a.b_c-d", True),
    ("./org/name", False), ("/abs/path", False), ("a/b/c", False), ("name", False),
    ("org/", False), ("../x", False), ("org/..", False),
])
def test_is_repo_id(name: str, expected: bool) -> None:
    assert is_repo_id(name) is expected


def test_hub_name_resolves_to_cached_snapshot(tmp_path: Path, tiny_folder: Path) -> None:
    cache = tmp_path / "cache"
    main = add_to_hub_cache(cache, "org/tiny", tiny_folder, "a" * 40)
    config = ModelConfig(model="org/tiny", download_dir=str(cache))
    resolved = resolve_model("org/tiny", download_dir=str(cache))
    assert resolved.path == main and resolved.format == "safetensors"
    assert model_folder(config) == main
    assert get_tokenizer(config).encode("Hello world")  # the tokenizer comes from there too


def test_revision_picks_its_snapshot(tmp_path: Path, tiny_folder: Path) -> None:
    cache = tmp_path / "cache"
    add_to_hub_cache(cache, "org/tiny", tiny_folder, "a" * 40)
    other = add_to_hub_cache(cache, "org/tiny", tiny_folder, "b" * 40, refs=("v2",))
    assert resolve_model("org/tiny", revision="v2", download_dir=str(cache)).path == other
    with pytest.raises(ValueError, match=r"^model: 'org/tiny' at revision 'v9' is not a local"):
        resolve_model("org/tiny", revision="v9", download_dir=str(cache))


def test_unknown_hub_name_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        resolve_model("org/missing", download_dir=str(tmp_path))
    message = str(err.value)
    assert message.startswith("model: 'org/missing' is not a local path") and "\n" not in message


def test_quantized_checkpoint_refused_by_method(tmp_path: Path, tiny_folder: Path) -> None:
    folder = tmp_path / "awq"
    shutil.copytree(tiny_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"awq"):
        resolve_model(str(folder))


def test_generate_cli_with_hub_name_and_hf_home(tmp_path: Path, tiny_folder: Path) -> None:
    """The CLI finds ``org/tiny`` in the cache ``HF_HOME`` points at, with the hub offline."""
    add_to_hub_cache(tmp_path / "hf" / "hub", "org/tiny", tiny_folder, "c" * 40)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(REPO_ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "pagedserve.entrypoints.cli", "generate", "Hello", "--model",
         "org/tiny", "--max-tokens", "4", "--temperature", "0", "--dtype", "float32"],
        capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip()
