"""Fixtures for engine tests: tiny random checkpoints (saved once per session) and LLM builders."""

from __future__ import annotations

import pytest
import torch

from tests.engine.tiny_models import ARCHS, save_checkpoint


@pytest.fixture(scope="session", autouse=True)
def _single_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """arch -> (folder, transformers model, tokenizer), built lazily."""
    cache: dict = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = save_checkpoint(arch, tmp_path_factory.mktemp(arch))
        return cache[arch]

    return get


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param
