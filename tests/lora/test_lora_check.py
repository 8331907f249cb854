"""The checks of a request's adapter outside the runner: the front end's (once per id) and
the engine core's at each arrival (a stat of the files while they are unchanged)."""

from __future__ import annotations

import os
import shutil

import pytest

from pagedserve.config import LoRAConfig
from pagedserve.lora import check as check_module
from pagedserve.lora.check import AdapterFiles, LoRAChecker
from pagedserve.lora.request import LoRARequest
from tests.engine.tiny_models import make_model, make_tokenizer
from tests.lora.peft_adapters import ADAPTER_CONFIGS, save_adapter


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """(base model config, a PEFT adapter folder)."""
    tokenizer = make_tokenizer()
    base = make_model("llama", len(tokenizer), tokenizer.eos_token_id)
    folder = tmp_path_factory.mktemp("check") / "qv"
    save_adapter(base, folder, 0, **ADAPTER_CONFIGS["qv"])
    return base.config, folder


def _read_again(*args: object) -> None:
    raise AssertionError("read again")


def test_front_end_checks_an_id_once_and_keeps_it_to_its_folder(adapter, tmp_path,
                                                               monkeypatch) -> None:
    hf_config, folder = adapter
    checker = LoRAChecker(hf_config, LoRAConfig(enable_lora=True, max_lora_rank=8))
    checker.check(LoRARequest("a", 1, str(folder)))
    monkeypatch.setattr(check_module, "check_adapter", _read_again)
    checker.check(LoRARequest("a", 1, str(folder)))  # known: not read again
    with pytest.raises(ValueError, match="lora_int_id 1 already names"):
        checker.check(LoRARequest("b", 1, str(tmp_path)))
    checker.forget(1)
    with pytest.raises(AssertionError, match="read again"):  # forgotten: checked again
        checker.check(LoRARequest("b", 1, str(tmp_path)))


def test_core_reads_again_only_what_changed(adapter, tmp_path, monkeypatch) -> None:
    hf_config, folder = adapter
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    files = AdapterFiles(hf_config, max_lora_rank=8)
    lora = LoRARequest("a", 1, str(copy))
    assert files.error(lora) is None
    calls = []
    real = check_module.check_adapter
    monkeypatch.setattr(check_module, "check_adapter",
                        lambda *args: calls.append(args) or real(*args))
    assert files.error(lora) is None and calls == []  # unchanged: a stat, no read
    config = copy / "adapter_config.json"
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert files.error(lora) is None and len(calls) == 1  # changed: checked again
    (copy / "adapter_model.safetensors").unlink()
    assert "no weights file" in files.error(lora)
    shutil.rmtree(copy)
    assert "is not a folder" in files.error(lora)
