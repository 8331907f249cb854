"""Many streaming clients at once, and clients that go away mid-request."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.entrypoints.openai.server_utils import (
    API_KEY,
    MAX_MODEL_LEN,
    ServerProcess,
    metric_value,
)

NUM_CLIENTS = 32
MAX_TOKENS = 6
LONG = MAX_MODEL_LEN - 16
"""Tokens of a request that would run for seconds (its client leaves long before)."""
WORDS = ["apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "ember"]


def _prompts() -> list[str]:
    return [f"{WORDS[i % 8]} {WORDS[(i // 8) % 8]} number {i}" for i in range(NUM_CLIENTS)]


def _wait_idle(server: ServerProcess, timeout: float) -> float:
    """Seconds until /metrics shows no running request and no KV block in use."""
    start = time.monotonic()
    while True:
        running = metric_value(server.url, "pagedserve:num_requests_running")
        usage = metric_value(server.url, "pagedserve:kv_cache_usage_perc")
        elapsed = time.monotonic() - start
        if running == 0 and usage == 0.0:
            return elapsed
        assert elapsed < timeout, f"after {elapsed:.1f} s: running {running}, kv usage {usage}"
        time.sleep(0.05)


def test_32_concurrent_streams_each_get_their_own_text(
    client: openai.OpenAI, server: ServerProcess, model_name: str
) -> None:
    prompts = _prompts()
    reference = client.completions.create(
        model=model_name,
        prompt=prompts,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    expected = [c.text for c in sorted(reference.choices, key=lambda c: c.index)]
    assert len(set(expected)) > NUM_CLIENTS // 2, "prompts should give distinct continuations"
    async_client = openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120
    )

    async def one(prompt: str) -> str:
        stream = await async_client.completions.create(
            model=model_name,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def run_all() -> list[str]:
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await async_client.close()

    assert asyncio.run(run_all()) == expected
    _wait_idle(server, timeout=5.0)


@pytest.mark.serial  # idle within 2 s
def test_stream_disconnect_aborts_within_2s(server: ServerProcess, model_name: str) -> None:
    body = {
        "model": model_name,
        "prompt": "Hello",
        "max_tokens": LONG,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=60) as http:
        with http.stream(
            "POST",
            f"{server.url}/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {API_KEY}"},
        ) as response:
            lines = response.iter_lines()  # kept: dropping the iterator closes the connection
            data = []
            while len(data) < 3:
                line = next(lines)
                if line.startswith("data:"):
                    data.append(line)
            assert metric_value(server.url, "pagedserve:num_requests_running") == 1
            assert metric_value(server.url, "pagedserve:kv_cache_usage_perc") > 0
        # Leaving the block closed the connection mid-stream.
    assert _wait_idle(server, timeout=2.0) < 2.0


@pytest.mark.serial  # idle within 2 s
def test_non_streaming_disconnect_aborts_within_2s(server: ServerProcess, model_name: str) -> None:
    body = {"model": model_name, "prompt": "Hello", "max_tokens": LONG, "ignore_eos": True}

    async def give_up_early() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            request = asyncio.ensure_future(
                http.post(
                    f"{server.url}/v1/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {API_KEY}"},
                )
            )
            deadline = time.monotonic() + 30
            while metric_value(server.url, "pagedserve:num_requests_running") == 0:
                assert time.monotonic() < deadline, "the request never started running"
                await asyncio.sleep(0.05)
            request.cancel()  # closes the connection
            await asyncio.gather(request, return_exceptions=True)

    asyncio.run(give_up_early())
    assert _wait_idle(server, timeout=2.0) < 2.0
