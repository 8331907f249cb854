"""The ``priority`` field under ``--policy priority``: of two requests waiting behind a
running one, the lower value is served first, whatever their arrival order."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.openai.server_utils import ServerProcess, metric_value

WAITING = "pagedserve:num_requests_waiting"


@pytest.fixture(scope="module")
def priority_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("priority") / "server.log"
    proc = ServerProcess(tiny_model_dir, log, "--policy", "priority", "--max-num-seqs", "1")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def _wait_for_waiting(server: ServerProcess, count: int) -> None:
    deadline = time.monotonic() + 60
    while metric_value(server.url, WAITING) < count:
        assert time.monotonic() < deadline, f"never {count} waiting requests"
        time.sleep(0.02)


def _hold_the_batch(server: ServerProcess, running: threading.Event,
                    release: threading.Event) -> None:
    """A long stream that occupies the one sequence slot until ``release`` (then aborted)."""
    body = {"prompt": "Hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        for _ in r.iter_lines():
            running.set()
            if release.wait(timeout=0.01):
                return


def test_lower_priority_value_is_served_first(priority_server: ServerProcess) -> None:
    running, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_the_batch, args=(priority_server, running, release))
    holder.start()
    finished: list[int] = []

    def complete(priority: int) -> None:
        r = httpx.post(f"{priority_server.url}/v1/completions", timeout=60, json={
            "prompt": "Hi", "max_tokens": 50, "ignore_eos": True, "priority": priority})
        assert r.status_code == 200, r.text
        finished.append(priority)

    try:
        assert running.wait(timeout=60)
        clients = [threading.Thread(target=complete, args=(p,)) for p in (5, -1)]
        for count, client in enumerate(clients, start=1):
            client.start()
            _wait_for_waiting(priority_server, count)  # 5 arrives first
    finally:
        release.set()
        holder.join(timeout=60)
    for client in clients:
        client.join(timeout=60)
    # One sequence at a time: the second finishes 50 steps after the first.
    assert finished == [-1, 5]
