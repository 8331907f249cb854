"""Fixtures for the structured-output tests: the engine tests' tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch

from tests.engine.tiny_models import save_checkpoint


@pytest.fixture(scope="session", autouse=True)
def _single_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(folder, transformers model, tokenizer) of the tiny random Llama."""
    return save_checkpoint("llama", tmp_path_factory.mktemp("llama"))
