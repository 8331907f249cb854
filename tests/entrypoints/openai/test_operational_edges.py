"""Start-up and exposure: a busy port fails at once (before the engine starts), a server open
to the network without a key says so, Host names are checked, /metrics shows no file path,
``--port 0`` names the chosen port, a generation_config.json gives the request defaults, a
request's own chat template needs --trust-request-chat-template, --enable-request-id-headers
adds X-Request-Id."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.openai.server_utils import (
    REPO_ROOT,
    ServerProcess,
    metric_value,
)
from tests.entrypoints.openai.test_errors import AUTH

BUSY_PORT_LIMIT_S = 30.0
"""The CLI's imports (seconds on a busy machine), then the failed bind."""


def _serve_on_busy_port(model_dir: Path, host: str) -> tuple[subprocess.CompletedProcess, float]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        start = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", str(model_dir),
             "--host", host, "--port", str(port), "--dtype", "float32"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        )
        return done, time.monotonic() - start


def test_busy_port_fails_at_once_and_an_open_host_without_key_warns(tiny_model_dir: Path):
    done, elapsed = _serve_on_busy_port(tiny_model_dir, "0.0.0.0")
    assert "listening on 0.0.0.0 without --api-key" in done.stderr, done.stderr
    assert done.returncode == 1 and "cannot listen on 0.0.0.0" in done.stderr, done.stderr
    assert elapsed < BUSY_PORT_LIMIT_S and "engine" not in done.stderr.lower()


def test_host_header_is_checked_on_loopback(server: ServerProcess):
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", "[::1]"):
        response = httpx.get(f"{server.url}/v1/models", headers={**AUTH, "Host": host})
        assert response.status_code == 200, (host, response.text)
    rebound = httpx.get(f"{server.url}/v1/models", headers={**AUTH, "Host": "evil.example"})
    assert rebound.status_code == 400 and rebound.json()["error"]["code"] == "invalid_host"


def test_metrics_show_no_model_path(server: ServerProcess, tiny_model_dir: Path):
    metric_value(server.url, "pagedserve:num_requests_running")  # the series exists
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert str(tiny_model_dir) not in text and f'model_name="{tiny_model_dir.name}"' in text


@pytest.fixture(scope="module")
def port_zero_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                     ) -> Iterator[str]:
    """One server for the tests below (a start costs seconds): ``--port 0`` (the system
    chooses) over a copy of the tiny model with a generation_config.json (max_new_tokens 3,
    temperature 0), with ``--enable-request-id-headers``. Yields the URL its banner names, once
    the model is ready."""
    folder = tmp_path_factory.mktemp("generation_config") / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "generation_config.json").write_text(
        json.dumps({"max_new_tokens": 3, "temperature": 0.0}))
    proc = ServerProcess(folder, folder.parent / "server.log", "--api-key",
                         AUTH["Authorization"][7:], "--enable-request-id-headers", port=0)
    try:
        proc.wait_ready()
        yield proc.url
    finally:
        proc.stop()


def test_port_zero_banner_names_the_chosen_port(port_zero_server: str):
    """``--port 0`` lets the system choose; the banner gives the port it chose, which answers."""
    port = int(port_zero_server.rsplit(":", 1)[1])
    assert port != 0
    assert httpx.get(f"{port_zero_server}/version", timeout=10).status_code == 200


def test_generation_config_gives_the_defaults_of_unset_fields(port_zero_server: str):
    """A model folder's generation_config.json (max_new_tokens 3, temperature 0): a request
    that sets neither gets 3 greedy tokens; one that sets max_tokens gets its own count."""
    with httpx.Client(base_url=port_zero_server, headers=AUTH, timeout=60) as http:
        def complete(**fields: object) -> dict:
            response = http.post("/v1/completions", json={"prompt": "Hello", **fields,
                                                         "ignore_eos": True})
            assert response.status_code == 200, response.text
            return response.json()

        first, second = complete(), complete()
        assert first["usage"]["completion_tokens"] == 3
        assert first["choices"][0]["text"] == second["choices"][0]["text"]  # greedy
        assert complete(max_tokens=5)["usage"]["completion_tokens"] == 5


def test_a_request_template_needs_the_trust_flag(port_zero_server: str):
    r = httpx.post(f"{port_zero_server}/v1/chat/completions", headers=AUTH, timeout=30, json={
        "messages": [{"role": "user", "content": "Hi"}], "chat_template": "{{ 1 }}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    assert "--trust-request-chat-template" in r.json()["error"]["message"]
    r = httpx.post(f"{port_zero_server}/tokenize", headers=AUTH, timeout=30, json={
        "messages": [{"role": "user", "content": "Hi"}], "chat_template": "{{ 1 }}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text


def test_request_id_headers(port_zero_server: str, server: ServerProcess):
    """``--enable-request-id-headers``: the client's X-Request-Id comes back, or a new one;
    without the option no response has the header."""
    given = httpx.get(f"{port_zero_server}/v1/models", headers={**AUTH, "X-Request-Id": "r-7"},
                      timeout=10)
    assert given.headers["x-request-id"] == "r-7"
    new = httpx.post(f"{port_zero_server}/v1/completions", headers=AUTH, timeout=30,
                     json={"prompt": "Hi", "max_tokens": 1})
    assert new.status_code == 200 and len(new.headers["x-request-id"]) == 32
    assert "x-request-id" not in httpx.get(f"{server.url}/health", timeout=10).headers
