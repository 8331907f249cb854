"""Back-pressure, client timeouts and graceful shutdown, over HTTP, on one server with 3
request slots, room for 1 waiting request and a 3 s shutdown timeout (the last test ends it)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest

from tests.entrypoints.openai.server_utils import ServerProcess, metric_value
from tests.reliability.reliability_utils import (
    RUNNING,
    WAITING,
    StreamResult,
    completion_body,
    stream_sse,
)
from tests.reliability.server_configs import LIFECYCLE_MAX_MODEL_LEN, SHUTDOWN_TIMEOUT_S

pytestmark = pytest.mark.serial  # SIGTERM and timeouts, timed against the wall clock

LONG = LIFECYCLE_MAX_MODEL_LEN - 16
"""A request that outlives the module."""
SHORT = 8
SLOTS = 3
"""The server's --max-num-seqs."""
QUEUED_TIMEOUT_S = 0.5
STREAM_TIMEOUT_S = 2.0


async def _until(condition: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


class Streams:
    """Streaming requests running as tasks on one client, each with its own result."""

    def __init__(self, http: httpx.AsyncClient, url: str) -> None:
        self.http = http
        self.url = url
        self.tasks: dict[str, asyncio.Task] = {}
        self.results: dict[str, StreamResult] = {}

    def start(self, name: str, body: dict) -> None:
        self.results[name] = StreamResult()
        stream = stream_sse(self.http, self.url, body, result=self.results[name])
        self.tasks[name] = asyncio.ensure_future(stream)

    async def first_event(self, name: str) -> None:
        await _until(lambda: bool(self.results[name].events), f"a first event of {name}")

    async def close(self, name: str) -> None:
        """The client goes away."""
        self.tasks[name].cancel()
        await asyncio.gather(self.tasks[name], return_exceptions=True)


def _overloaded(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers.get("retry-after") == "1"
    error = response.json()["error"]
    assert error["code"] == "server_overloaded" and error["type"] == "service_unavailable_error"


@pytest.fixture(scope="module")
def model(model_name: str) -> str:
    return model_name


def test_back_pressure_and_timeouts(
    lifecycle_server: ServerProcess, model: str, figures: dict
) -> None:
    asyncio.run(_back_pressure_and_timeouts(lifecycle_server.url, model, figures))


async def _back_pressure_and_timeouts(url: str, model: str, figures: dict) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        streams = Streams(http, url)
        # One at a time: a request counts as waiting until its first token.
        for i in range(SLOTS):
            streams.start(f"long {i}", completion_body(model, f"Hello {i}", LONG))
            await streams.first_event(f"long {i}")
        streams.start("C", completion_body(model, "Berlin", LONG))  # no slot: it waits
        await _until(lambda: metric_value(url, WAITING) == 1, "C waiting")

        # Beyond the 1 waiting request: 503 + Retry-After, on every generating route.
        refused = 0
        for path, body in (
            ("/v1/completions", completion_body(model, "x", 2)),
            ("/v1/completions", completion_body(model, "x", 2, stream=True)),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ):
            _overloaded(await http.post(f"{url}{path}", json={"model": model, **body}))
            refused += 1
        assert metric_value(url, WAITING) == 1

        # C leaves: the waiting room is free again; a queued request with a timeout gets 408.
        await streams.close("C")
        await _until(lambda: metric_value(url, WAITING) == 0, "C aborted")
        start = time.monotonic()
        queued = await http.post(
            f"{url}/v1/completions",
            json=completion_body(model, "x", 4, timeout=QUEUED_TIMEOUT_S),
        )
        queued_s = time.monotonic() - start
        assert queued.status_code == 408, queued.text
        assert queued.json()["error"]["code"] == "request_timeout"
        assert QUEUED_TIMEOUT_S <= queued_s < QUEUED_TIMEOUT_S + 1.0
        await _until(lambda: metric_value(url, WAITING) == 0, "the timed-out request aborted")

        for i in range(SLOTS):
            await streams.close(f"long {i}")
        await _until(lambda: metric_value(url, RUNNING) == 0, "the long streams aborted")

        # Alone (so it streams quickly), a stream with a timeout ends with the timeout event.
        start = time.monotonic()
        timed = await stream_sse(
            http, url, completion_body(model, "Hi", LONG, timeout=STREAM_TIMEOUT_S)
        )
        assert timed.status == 200 and timed.done and timed.text
        assert timed.error is not None and timed.error["code"] == "request_timeout"
        assert STREAM_TIMEOUT_S <= timed.event_times[-1] - start < STREAM_TIMEOUT_S + 1.0
        await _until(lambda: metric_value(url, RUNNING) == 0, "the timed-out stream aborted")
        figures["back-pressure: refused beyond --max-waiting-requests 1"] = (
            f"{refused} requests answered 503 + Retry-After; waiting queue stayed at 1"
        )
        figures["timeouts: queued / streaming request with a client timeout"] = (
            f"408 after {queued_s:.2f} s (timeout {QUEUED_TIMEOUT_S} s) / error event after "
            f"{len(timed.events) - 1} chunks (timeout {STREAM_TIMEOUT_S} s); both aborted"
        )


def test_sigterm_finishes_short_requests_and_cuts_long_ones(
    lifecycle_server: ServerProcess, model: str, figures: dict
) -> None:
    """SIGTERM: no new connection; the short in-flight stream finishes; the long stream ends
    with a ``server_shutting_down`` error event and the long non-streaming request with a 503
    of that code, at the shutdown timeout; the process exits 0."""
    outcome = asyncio.run(_sigterm_with_requests_in_flight(lifecycle_server, model))
    assert outcome.exit_code == 0, lifecycle_server.log()
    assert outcome.refused_after < 1.0
    short = outcome.short_stream
    assert short.error is None and short.done and short.usage["completion_tokens"] == SHORT
    assert outcome.long_stream.done
    assert outcome.long_stream.error["code"] == "server_shutting_down"
    assert outcome.long_full.status_code == 503, outcome.long_full.text
    assert outcome.long_full.json()["error"]["code"] == "server_shutting_down"
    assert SHUTDOWN_TIMEOUT_S - 0.5 <= outcome.cut_after <= SHUTDOWN_TIMEOUT_S + 1.0
    assert outcome.exited_after <= SHUTDOWN_TIMEOUT_S + 5.0
    figures[f"graceful shutdown (SIGTERM, --shutdown-timeout {SHUTDOWN_TIMEOUT_S:g})"] = (
        f"new connections refused after {outcome.refused_after:.2f} s; the short stream "
        f"finished; the long stream and the long non-streaming request ended with "
        f"server_shutting_down at {outcome.cut_after:.2f} s; exit 0 at "
        f"{outcome.exited_after:.2f} s"
    )


@dataclass
class ShutdownOutcome:
    long_stream: StreamResult
    long_full: httpx.Response
    short_stream: StreamResult
    refused_after: float
    """Seconds from SIGTERM to the first refused connection."""
    cut_after: float
    """Seconds from SIGTERM to the long stream's error event."""
    exit_code: int
    exited_after: float


async def _sigterm_with_requests_in_flight(server: ServerProcess, model: str) -> ShutdownOutcome:
    url = server.url
    async with httpx.AsyncClient(timeout=60) as http:
        streams = Streams(http, url)
        streams.start("long", completion_body(model, "Hello", LONG))
        await streams.first_event("long")
        long_full = asyncio.ensure_future(
            http.post(f"{url}/v1/completions", json=completion_body(model, "Berlin", LONG))
        )
        await _until(lambda: metric_value(url, RUNNING) == 2, "the non-streaming request running")
        usage = {"stream_options": {"include_usage": True}}
        streams.start("short", completion_body(model, "Paris", SHORT, **usage))
        await streams.first_event("short")

        server.proc.send_signal(signal.SIGTERM)
        sigterm_at = time.monotonic()
        refused_after = await _until_refused(url) - sigterm_at
        long_stream = await streams.tasks["long"]
        short_stream = await streams.tasks["short"]
        full = await long_full
    exit_code = await asyncio.to_thread(server.proc.wait, SHUTDOWN_TIMEOUT_S + 10)
    exited_after = time.monotonic() - sigterm_at
    server.stop()  # closes its log
    return ShutdownOutcome(
        long_stream=long_stream,
        long_full=full,
        short_stream=short_stream,
        refused_after=refused_after,
        cut_after=long_stream.event_times[-1] - sigterm_at,
        exit_code=exit_code,
        exited_after=exited_after,
    )


async def _until_refused(url: str) -> float:
    """When a new connection is first refused (the listening socket closed)."""
    deadline = time.monotonic() + 5.0
    async with httpx.AsyncClient(timeout=1.0) as fresh:
        while time.monotonic() < deadline:
            try:
                await fresh.get(f"{url}/version", headers={"Connection": "close"})
            except httpx.ConnectError:
                return time.monotonic()
            await asyncio.sleep(0.02)
    raise AssertionError("the server still accepts connections 5 s after SIGTERM")
