"""Fixtures: a tiny random Llama (real byte-level BPE tokenizer and chat template) and one
real server process shared by the test modules that do not break it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.engine.tiny_models import save_checkpoint
from tests.entrypoints.openai.server_utils import (
    API_KEY,
    MAX_MODEL_LEN,
    SHARED_SERVER_MAX_CONNECTIONS,
    ServerProcess,
    running_server,
)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine tests' tiny Llama, with a context long enough that a request can run for
    seconds (rotary embeddings are computed for any position)."""
    folder = tmp_path_factory.mktemp("tiny_llama_server")
    save_checkpoint("llama", folder)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["max_position_embeddings"] = MAX_MODEL_LEN
    config_file.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """One server shared by the test modules that do not break it (starting one costs seconds
    of CPU); the API key is on, so every route's auth is exercised, and requests may bring
    their own chat template."""
    log = tmp_path_factory.mktemp("server_log") / "server.log"
    with running_server(tiny_model_dir, log, "--api-key", API_KEY,
                        "--max-connections", str(SHARED_SERVER_MAX_CONNECTIONS),
                        "--trust-request-chat-template") as proc:
        yield proc


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model_name(tiny_model_dir: Path) -> str:
    return str(tiny_model_dir)
