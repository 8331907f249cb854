"""Faults: the engine process SIGKILLed, or stopped (SIGSTOP: hung) on a server with a short
``--engine-timeout``, while streaming and non-streaming requests of both APIs run. Every one
of them ends with an error within 5 s (after the engine timeout, for the hung engine),
``/health`` turns 503, the gauges read 0, the API process keeps answering (new requests get
503 at once), and SIGTERM still ends it cleanly."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from tests.entrypoints.openai.server_utils import ServerProcess, metric_value
from tests.reliability.reliability_utils import (
    RUNNING,
    StreamResult,
    completion_body,
    engine_state,
    stream_sse,
)
from tests.reliability.server_configs import HANG_ENGINE_TIMEOUT_S

pytestmark = pytest.mark.serial  # requests must end within seconds of the fault

LONG = 3000
"""Tokens of a request that runs far longer than the test."""
DEADLINE_S = 5.0
LAST_STEP_SLACK_S = 0.25
"""The server counts the engine's silence from its last step, which came before the signal
by up to one step of the tiny model: a request may end that much before the timeout."""
CHAT_PATH = "/v1/chat/completions"


def _chat_body(model: str) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": LONG,
        "ignore_eos": True,
    }


async def _in_flight(http: httpx.AsyncClient, url: str, model: str) -> dict[str, asyncio.Task]:
    """Start the requests, and return once all of them run in the engine."""
    body = completion_body(model, "Hello", LONG)
    tasks = {
        "stream 1": stream_sse(http, url, body),
        "stream 2": stream_sse(http, url, {**body, "n": 2}),
        "chat stream": stream_sse(http, url, _chat_body(model), path=CHAT_PATH),
        "non-stream": http.post(f"{url}/v1/completions", json=body),
        "chat non-stream": http.post(f"{url}{CHAT_PATH}", json=_chat_body(model)),
    }
    running = {name: asyncio.ensure_future(coro) for name, coro in tasks.items()}
    deadline = time.monotonic() + 60
    while metric_value(url, RUNNING) < len(tasks) + 1:  # n=2 runs as two requests
        assert time.monotonic() < deadline, "the requests never all ran"
        await asyncio.sleep(0.05)
    return running


def _check_ended_with_error(name: str, outcome: object) -> None:
    if isinstance(outcome, StreamResult):
        assert outcome.status == 200 and outcome.done, (name, outcome)
        assert outcome.error is not None and outcome.error["code"] == "engine_dead", name
        assert outcome.error["type"] == "service_unavailable_error"
        return
    assert isinstance(outcome, httpx.Response), (name, outcome)
    assert outcome.status_code == 503, (name, outcome.text)
    assert outcome.json()["error"]["code"] == "engine_dead"


async def _signal_engine_mid_generation(
    server: ServerProcess, model: str, signum: int, deadline: float
) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=60) as http:
        tasks = await _in_flight(http, server.url, model)
        return await _signal_and_time(server, tasks, signum, deadline)


async def _signal_and_time(
    server: ServerProcess, tasks: dict[str, asyncio.Task], signum: int, deadline: float
) -> dict[str, float]:
    """Send ``signum`` to the engine; seconds until each request ended (each with its error)."""
    os.kill(server.engine_pid(), signum)
    killed_at = time.monotonic()
    ended_after: dict[str, float] = {}

    async def timed(name: str, task: asyncio.Task) -> None:
        outcome = await task
        ended_after[name] = time.monotonic() - killed_at
        _check_ended_with_error(name, outcome)

    await asyncio.wait_for(
        asyncio.gather(*(timed(n, t) for n, t in tasks.items())), timeout=deadline
    )
    return ended_after


def test_engine_killed_mid_generation(
    faults_server: ServerProcess, model_name: str, figures: dict
) -> None:
    ended_after = asyncio.run(
        _signal_engine_mid_generation(faults_server, model_name, signal.SIGKILL, DEADLINE_S)
    )
    assert max(ended_after.values()) < DEADLINE_S
    figures["faults: engine SIGKILLed with requests in flight"] = _check_dead_server(
        faults_server, model_name, ended_after
    )


def test_hung_engine_mid_generation(
    hang_server: ServerProcess, model_name: str, figures: dict
) -> None:
    deadline = HANG_ENGINE_TIMEOUT_S + DEADLINE_S
    ended_after = asyncio.run(
        _signal_engine_mid_generation(hang_server, model_name, signal.SIGSTOP, deadline)
    )
    assert HANG_ENGINE_TIMEOUT_S - LAST_STEP_SLACK_S <= min(ended_after.values())
    assert max(ended_after.values()) < deadline
    figures[
        f"faults: engine stopped (SIGSTOP) with requests in flight, --engine-timeout "
        f"{HANG_ENGINE_TIMEOUT_S:g}"
    ] = _check_dead_server(hang_server, model_name, ended_after)


def _check_dead_server(server: ServerProcess, model_name: str, ended_after: dict) -> str:
    """After the engine's death: 503s, the open routes, gauges at 0, a clean SIGTERM."""
    url = server.url
    health = httpx.get(f"{url}/health", timeout=5)
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    start = time.monotonic()
    late = httpx.post(f"{url}/v1/completions", json=completion_body(model_name, "Hi", 2), timeout=5)
    refused_in = time.monotonic() - start
    assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"
    assert refused_in < 1.0
    assert httpx.get(f"{url}/version", timeout=5).status_code == 200
    assert engine_state(url) == (0.0, 0.0, 0.0)  # running, waiting, KV usage

    start = time.monotonic()
    assert server.stop(timeout=20) == 0, server.log()
    stopped_in = time.monotonic() - start
    return (
        f"{len(ended_after)} requests ended with engine_dead after "
        f"{min(ended_after.values()):.2f}-{max(ended_after.values()):.2f} s; /health 503; "
        f"gauges running / waiting / KV usage 0 / 0 / 0.0; a new request refused in "
        f"{refused_in * 1000:.0f} ms; SIGTERM then exited 0 in {stopped_in:.1f} s"
    )
