"""A server of its own (this module breaks it): 503 while the model loads (its engine held
stopped until then), the engine process killed mid-generation, and a clean exit on SIGTERM
afterwards."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.openai.server_utils import ServerProcess, metric_value

RUNNING = "pagedserve:num_requests_running"
KV_USAGE = "pagedserve:kv_cache_usage_perc"

pytestmark = pytest.mark.serial  # seconds to fail requests and to exit on SIGTERM


@pytest.fixture(scope="module")
def own_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    proc = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("death") / "server.log")
    try:
        _hold_engine_until_health_answers(proc)
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def _hold_engine_until_health_answers(server: ServerProcess) -> None:
    """Stop the engine process (SIGSTOP) from its spawn until /health has answered 503, then
    let it go on: the server spawns it first, and the tiny model would be loaded before the
    server listens."""
    deadline = time.monotonic() + 60
    while True:
        try:
            pid = server.engine_pid()
            break
        except RuntimeError:
            if time.monotonic() > deadline or server.proc.poll() is not None:
                raise
            time.sleep(0.01)
    os.kill(pid, signal.SIGSTOP)
    try:
        server.wait_for_health(503)
    finally:
        os.kill(pid, signal.SIGCONT)


def _stream_events(
    server: ServerProcess, model: str, events: list[dict], first: threading.Event
) -> None:
    body = {
        "model": model,
        "prompt": "Hello",
        "max_tokens": 4000,  # far more than the tiny model makes before the kill lands
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
                first.set()


def test_starting_engine_answers_503(own_server: ServerProcess) -> None:
    assert 503 in own_server.health_statuses, own_server.health_statuses
    assert own_server.health_statuses[-1] == 200


def test_killed_engine_fails_requests_and_health(
    own_server: ServerProcess, model_name: str
) -> None:
    events: list[dict] = []
    first = threading.Event()
    reader = threading.Thread(target=_stream_events, args=(own_server, model_name, events, first))
    reader.start()
    assert first.wait(60), "no token streamed"
    assert metric_value(own_server.url, RUNNING) == 1 and metric_value(own_server.url, KV_USAGE)
    os.kill(own_server.engine_pid(), signal.SIGKILL)
    killed_at = time.monotonic()
    reader.join(10)
    assert not reader.is_alive(), "the stream did not end after the engine died"
    assert time.monotonic() - killed_at < 5.0
    error = events[-1]["error"]
    assert error["code"] == "engine_dead" and error["type"] == "service_unavailable_error"

    health = httpx.get(f"{own_server.url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    late = httpx.post(
        f"{own_server.url}/v1/completions",
        timeout=10,
        json={"model": model_name, "prompt": "Hello", "max_tokens": 2},
    )
    assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"
    # Nothing runs any more: the gauges say so instead of keeping their last values.
    assert metric_value(own_server.url, RUNNING) == 0 == metric_value(own_server.url, KV_USAGE)
    # The API process itself is alive and answers the open routes.
    assert httpx.get(f"{own_server.url}/version", timeout=10).status_code == 200


def test_sigterm_exits_cleanly(own_server: ServerProcess) -> None:
    start = time.monotonic()
    assert own_server.stop(timeout=20) == 0, own_server.log()
    assert time.monotonic() - start < 20
