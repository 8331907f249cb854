"""Fixtures of the reliability tests: a tiny random Llama, and the real server processes the
test modules need, started together on first use (their start-ups overlap), each with the
options its tests are about. The figures the tests measure are printed at the end of the run
(``RELIABILITY.md`` records them)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.tiny_models import save_checkpoint
from tests.entrypoints.openai.server_utils import ServerProcess
from tests.reliability.reliability_utils import start_servers
from tests.reliability.server_configs import LIFECYCLE_MAX_MODEL_LEN, SERVER_ARGS, SERVER_ENV

FIGURES = pytest.StashKey[dict[str, object]]()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_llama_reliability")
    save_checkpoint("llama", folder)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["max_position_embeddings"] = LIFECYCLE_MAX_MODEL_LEN
    config_file.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def model_name(tiny_model_dir: Path) -> str:
    return str(tiny_model_dir)


@pytest.fixture(scope="session")
def servers(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ServerProcess]]:
    """Every server some collected test asks for, started at once; stopped at the end (a test
    that stops or breaks its server first is fine: ``stop`` is idempotent)."""
    wanted = {
        name
        for item in request.session.items
        for name in getattr(item, "fixturenames", ())
        if name in SERVER_ARGS
    }
    log_dir = tmp_path_factory.mktemp("server_logs")
    started = start_servers(tiny_model_dir, log_dir, {n: SERVER_ARGS[n] for n in sorted(wanted)},
                            SERVER_ENV)
    try:
        yield started
    finally:
        for proc in started.values():
            proc.stop()


def _ready(servers: dict[str, ServerProcess], name: str) -> ServerProcess:
    proc = servers[name]
    proc.wait_ready()
    return proc


@pytest.fixture(scope="session")
def main_server(servers: dict[str, ServerProcess]) -> ServerProcess:
    """Shared by the tests that leave it serving (load, bad input, fuzz, benchmark)."""
    return _ready(servers, "main_server")


@pytest.fixture(scope="session")
def pressure_server(servers: dict[str, ServerProcess]) -> ServerProcess:
    return _ready(servers, "pressure_server")


@pytest.fixture(scope="session")
def lifecycle_server(servers: dict[str, ServerProcess]) -> ServerProcess:
    """Back-pressure, timeouts, then SIGTERM (its module ends it)."""
    return _ready(servers, "lifecycle_server")


@pytest.fixture(scope="session")
def faults_server(servers: dict[str, ServerProcess]) -> ServerProcess:
    """Its engine process is killed."""
    return _ready(servers, "faults_server")


@pytest.fixture(scope="session")
def hang_server(servers: dict[str, ServerProcess]) -> ServerProcess:
    """Its engine process is stopped (hung), then killed by the engine timeout."""
    return _ready(servers, "hang_server")


@pytest.fixture(scope="session")
def figures(request: pytest.FixtureRequest) -> dict[str, object]:
    """Figures measured by the tests, printed at the end of the run."""
    return request.config.stash.setdefault(FIGURES, {})


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    measured = config.stash.get(FIGURES, {})
    if measured:
        terminalreporter.section("reliability figures")
        for key, value in measured.items():
            terminalreporter.write_line(f"{key}: {value}")
