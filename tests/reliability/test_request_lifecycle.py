"""The ways a request ends early, in process and fast: ``AsyncLLM`` over a real engine process
with the model-free core (a client timeout, a drain on shutdown, beam searches included), and
the body-size limit of the HTTP app."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request

from pagedserve.beam_search import BeamSearchParams
from pagedserve.config import EngineConfig
from pagedserve.engine.async_llm import (
    AsyncLLM,
    EngineState,
    RequestTimeoutError,
    ServerShuttingDownError,
)
from pagedserve.engine.core_client import EngineProcess
from pagedserve.entrypoints.openai.app import ServerSettings, build_app
from pagedserve.entrypoints.openai.body_limit import BodySizeLimit
from pagedserve.entrypoints.openai.errors import install_error_handlers
from pagedserve.entrypoints.openai.metrics import ServerMetrics
from pagedserve.sampling_params import SamplingParams
from tests.engine.fake_core import FakeCore
from tests.engine.tiny_models import make_tokenizer

LONG = 50_000
"""Tokens of a request that would run for minutes on the fake core."""


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


async def _started(tokenizer, tmp_path: Path) -> AsyncLLM:
    config = EngineConfig.from_kwargs(max_model_len=LONG + 16)
    engine = AsyncLLM(config, tokenizer, tmp_path, EngineProcess(config, FakeCore))
    await engine.start()
    return engine


async def _until_idle(engine: AsyncLLM, timeout: float = 5.0) -> None:
    """The core reports no request (its stats arrive with every engine-loop iteration)."""
    deadline = time.monotonic() + timeout
    while engine.latest_stats is None or engine.latest_stats.num_running:
        assert time.monotonic() < deadline, f"still running: {engine.latest_stats}"
        await asyncio.sleep(0.01)


def test_timeout_aborts_the_request(tokenizer, tmp_path: Path) -> None:
    async def run() -> None:
        engine = await _started(tokenizer, tmp_path)
        try:
            processed = engine.process_inputs([1, 2], SamplingParams(max_tokens=LONG))
            stream = await engine.submit(processed, timeout=0.2)
            outputs = 0
            with pytest.raises(RequestTimeoutError, match="0.2 s"):
                async for _ in stream:
                    outputs += 1
            elapsed = time.monotonic() - processed.arrival_time
            assert outputs > 0 and 0.2 <= elapsed < 1.0
            stream.close()
            await _until_idle(engine)
            assert engine.num_in_flight == 0
            # A request that finishes in time is not affected by its timeout.
            short = engine.process_inputs([3], SamplingParams(max_tokens=3))
            done = [o async for o in await engine.submit(short, timeout=30.0)]
            assert done[-1].finished and engine.num_in_flight == 0
            with pytest.raises(ValueError, match="timeout"):
                await engine.submit(engine.process_inputs([3], SamplingParams()), timeout=0)
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_drain_finishes_short_requests_and_cuts_long_ones(tokenizer, tmp_path: Path) -> None:
    async def run() -> None:
        engine = await _started(tokenizer, tmp_path)
        try:
            long = await engine.submit(engine.process_inputs([1], SamplingParams(max_tokens=LONG)))
            short = await engine.submit(engine.process_inputs([2], SamplingParams(max_tokens=20)))
            drain = asyncio.ensure_future(engine.drain(timeout=0.5))
            await asyncio.sleep(0)
            assert engine.state is EngineState.DRAINING
            with pytest.raises(ServerShuttingDownError):
                engine.process_inputs([3], SamplingParams(max_tokens=2))
            health = await _get(engine, "/health")  # a connection that was already open
            assert health.status_code == 503
            assert health.json()["error"]["code"] == "server_shutting_down"
            short_outputs = [o async for o in short]
            assert short_outputs[-1].finished
            assert sum(len(o.outputs[0].token_ids) for o in short_outputs) == 20
            with pytest.raises(ServerShuttingDownError, match="shutdown timeout"):
                async for _ in long:
                    pass
            assert await drain == 1
            await _until_idle(engine)
            assert engine.num_in_flight == 0
        finally:
            await engine.shutdown()
        assert await engine.drain(timeout=5.0) == 0  # nothing in flight: returns at once

    asyncio.run(run())


def test_drain_lets_a_beam_search_finish_and_cuts_a_long_one(tokenizer, tmp_path: Path) -> None:
    """A beam search's rounds go on while the server drains (they are not new requests);
    one that outlives the shutdown timeout is cut like any request, its round aborted."""
    async def run() -> None:
        engine = await _started(tokenizer, tmp_path)
        try:
            beams = BeamSearchParams(beam_width=2, max_tokens=40)
            short = await engine.submit(engine.process_inputs([5], beams))
            long = await engine.submit(
                engine.process_inputs([9], BeamSearchParams(beam_width=2, max_tokens=LONG)))
            drain = asyncio.ensure_future(engine.drain(timeout=3.0))  # the short one: 40 rounds
            (output,) = [o async for o in short]
            assert engine.state is EngineState.DRAINING  # its 40 rounds ran while draining
            # The fake core's best next token is always the last one + 1.
            assert output.outputs[0].token_ids == list(range(6, 46))
            assert [c.index for c in output.outputs] == [0, 1]
            with pytest.raises(ServerShuttingDownError, match="shutdown timeout"):
                async for _ in long:
                    pass
            # The long search, and those of its round's two expansions that were in flight.
            assert 1 <= await drain <= 3
            await _until_idle(engine)
            assert engine.num_in_flight == 0
        finally:
            await engine.shutdown()

    asyncio.run(run())


async def _get(engine: AsyncLLM, path: str) -> httpx.Response:
    """GET from the server's app over ``engine``, in process (no lifespan: the engine runs)."""
    settings = ServerSettings(served_model_names=["tiny"], model_root="tiny")
    app = build_app(engine, ServerMetrics("tiny"), settings)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
        return await http.get(path)


def _app(max_bytes: int) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_bytes)

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"size": len(await request.body())}

    return app


@pytest.fixture
def http() -> Iterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=_app(max_bytes=1000))
    client = httpx.AsyncClient(transport=transport, base_url="http://app")
    yield client


def _post(http: httpx.AsyncClient, content: object) -> httpx.Response:
    return asyncio.run(http.post("/echo", content=content))


def _chunks(size: int) -> object:
    async def gen():  # noqa: ANN202
        for _ in range(size // 100):
            yield b"x" * 100

    return gen()


def test_body_limit(http: httpx.AsyncClient) -> None:
    assert _post(http, b"x" * 1000).json() == {"size": 1000}
    assert _post(http, _chunks(1000)).json() == {"size": 1000}
    for too_large in (b"x" * 1001, _chunks(1100)):
        response = _post(http, too_large)
        assert response.status_code == 413
        error = response.json()["error"]
        assert error["code"] == "request_too_large" and "1000 bytes" in error["message"]
        assert error["type"] == "invalid_request_error"
    with pytest.raises(ValueError, match="max_request_body_bytes"):
        BodySizeLimit(_app(10), max_bytes=0)
