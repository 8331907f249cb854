"""The engine process and its ZeroMQ pipes, with a model-free core: requests in, outputs and
stats out, aborts free at once, and the API side learns of the engine's death in time."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from pagedserve.config import EngineConfig
from pagedserve.core.request import Request, RequestStatus
from pagedserve.engine.core_client import EngineCoreClient, EngineProcess
from pagedserve.engine.core_proc import EngineDeadError, StepResult
from pagedserve.sampling_params import SamplingParams
from tests.engine.fake_core import CRASH_TOKEN, MAX_MODEL_LEN, VOCAB_SIZE, FakeCore, expected_tokens


def _request(req_id: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), None, max_tokens)


async def _collect(
    client: EngineCoreClient, req_ids: set[str], timeout: float = 10.0
) -> tuple[dict[str, list[int]], dict[str, str], StepResult]:
    """Tokens and finish reasons until every request in ``req_ids`` finished; the last step."""
    tokens: dict[str, list[int]] = {r: [] for r in req_ids}
    reasons: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    step = None
    while set(reasons) != req_ids:
        assert time.monotonic() < deadline, (
            f"unfinished after {timeout} s: {req_ids - set(reasons)}"
        )
        step = await client.get_output()
        for out in step.outputs:
            tokens[out.req_id] += out.new_token_ids
            if out.finish_reason is not None:
                reasons[out.req_id] = out.finish_reason
    return tokens, reasons, step


async def _until_idle(client: EngineCoreClient, timeout: float) -> StepResult:
    deadline = time.monotonic() + timeout
    while True:
        step = await asyncio.wait_for(client.get_output(), max(deadline - time.monotonic(), 0.01))
        if step.stats.num_running == 0:
            return step


def test_requests_round_trip() -> None:
    async def run() -> None:
        client = EngineCoreClient(EngineProcess(EngineConfig(), FakeCore))
        try:
            info = await client.wait_ready()
            assert (info.max_model_len, info.vocab_size) == (MAX_MODEL_LEN, VOCAB_SIZE)
            await client.add_request(_request("a", [5, 6], 4))
            await client.add_request(_request("b", [10], 7))
            tokens, reasons, last = await _collect(client, {"a", "b"})
            assert tokens == {"a": expected_tokens([5, 6], 4), "b": expected_tokens([10], 7)}
            assert reasons == {"a": "length", "b": "length"}
            assert last.stats.num_running == 0 and last.stats.generation_tokens == 11
        finally:
            await client.shutdown()
        assert client.engine.proc.exitcode == 0

    asyncio.run(run())


@pytest.mark.serial  # idle within 2 s
def test_abort_frees_at_once_and_queue_times_are_reported() -> None:
    async def run() -> None:
        client = EngineCoreClient(EngineProcess(EngineConfig(), FakeCore))
        try:
            await client.wait_ready()
            await client.add_request(_request("long", [1], 100_000))
            queue_times: list[float] = []
            while not queue_times:
                step = await client.get_output()
                queue_times += step.queue_times
            assert 0.0 <= queue_times[0] < 5.0
            assert step.stats.num_running == 1
            await client.abort_requests(["long"])
            start = time.monotonic()
            idle = await _until_idle(client, timeout=2.0)
            assert time.monotonic() - start < 2.0
            assert idle.stats.kv_cache_usage == 0.0
            # The engine keeps serving, and a stop-string finish frees just as well.
            await client.add_request(_request("next", [2], 100_000))
            await client.get_output()
            await client.finish_requests(["next"], RequestStatus.FINISHED_STOPPED)
            await _until_idle(client, timeout=2.0)
        finally:
            await client.shutdown()

    asyncio.run(run())


def test_refused_request_ends_aborted_and_engine_keeps_serving() -> None:
    async def run() -> None:
        client = EngineCoreClient(EngineProcess(EngineConfig(), FakeCore))
        try:
            await client.wait_ready()
            await client.add_request(_request("huge", [1] * (MAX_MODEL_LEN + 1), 5))
            tokens, reasons, _ = await _collect(client, {"huge"})
            assert reasons == {"huge": "abort"} and tokens == {"huge": []}
            await client.add_request(_request("ok", [3], 2))
            tokens, _, _ = await _collect(client, {"ok"})
            assert tokens["ok"] == expected_tokens([3], 2)
        finally:
            await client.shutdown()

    asyncio.run(run())


@pytest.mark.serial  # noticed within 2 s
def test_sigkill_is_noticed_at_once() -> None:
    async def run() -> None:
        client = EngineCoreClient(EngineProcess(EngineConfig(), FakeCore))
        try:
            await client.wait_ready()
            await client.add_request(_request("long", [1], 100_000))
            await client.get_output()
            os.kill(client.pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(EngineDeadError, match="exit code -9"):
                while True:
                    await asyncio.wait_for(client.get_output(), 5.0)
            assert time.monotonic() - start < 2.0
            assert client.is_dead
            with pytest.raises(EngineDeadError):
                await client.add_request(_request("after", [1], 1))
        finally:
            await client.shutdown()

    asyncio.run(run())


def test_engine_exception_reaches_the_api_side() -> None:
    async def run() -> None:
        client = EngineCoreClient(EngineProcess(EngineConfig(), FakeCore))
        try:
            await client.wait_ready()
            await client.add_request(_request("boom", [CRASH_TOKEN], 5))
            with pytest.raises(EngineDeadError, match="fake crash on request boom"):
                while True:
                    await asyncio.wait_for(client.get_output(), 10.0)
        finally:
            await client.shutdown()
        assert client.engine.proc.exitcode == 1

    asyncio.run(run())


def _failing_core(config: EngineConfig) -> FakeCore:
    raise ValueError("model: /nowhere does not exist")


def test_start_failure_is_reported() -> None:
    async def run() -> None:
        client = EngineCoreClient(EngineProcess(EngineConfig(), _failing_core))
        try:
            with pytest.raises(EngineDeadError, match="/nowhere does not exist"):
                await client.wait_ready()
        finally:
            await client.shutdown()

    asyncio.run(run())
