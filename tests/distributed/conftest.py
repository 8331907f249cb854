"""Tiny checkpoints (built once per session) and their TP=1 outputs, the reference every
tensor-parallel engine must reproduce."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM
from tests.distributed.tiny_tp import ENGINE_ARGS, generate, save_checkpoint


@pytest.fixture(scope="session", autouse=True)
def _single_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """arch -> folder of its tiny checkpoint, built lazily."""
    cache: dict = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = save_checkpoint(arch, tmp_path_factory.mktemp(arch))
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def tp1_outputs(checkpoint):
    """arch -> the in-process TP=1 engine's outputs for the shared prompts."""
    cache: dict = {}

    def get(arch: str):
        if arch not in cache:
            llm = LLM(str(checkpoint(arch)), **ENGINE_ARGS)
            assert llm.engine_core.model_runner is not None  # the in-process runner
            cache[arch] = generate(llm)
        return cache[arch]

    return get
