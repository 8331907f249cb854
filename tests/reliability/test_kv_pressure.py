"""KV pressure: a pool of 11 usable blocks of 4 tokens, and requests of up to 31 tokens (8
blocks) sent together, so they preempt each other again and again. Every output still equals
the one its prompt gets alone (where nothing is preempted), the preemption counter shows the
pressure, and no block stays in use afterwards."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.entrypoints.openai.server_utils import ServerProcess, metric_value
from tests.reliability.reliability_utils import (
    PREEMPTIONS,
    completion_body,
    greedy_alone,
    stream_sse,
    wait_idle,
)
from tests.reliability.server_configs import PRESSURE_BLOCK_SIZE, PRESSURE_NUM_BLOCKS

NUM_REQUESTS = 10
MAX_TOKENS = 24
MIN_PREEMPTIONS = NUM_REQUESTS
"""One request fits at a time: each of the others is preempted as it grows, again and again."""
WORDS = ["quick", "brown", "fox", "lazy", "dog", "Paris", "Berlin", "capital"]


def _prompts() -> list[str]:
    """Words of the tiny tokenizer's corpus: 5 to 7 tokens each."""
    return [f"{WORDS[i % 8]} {WORDS[(5 * i + 3) % 8]} {i}" for i in range(NUM_REQUESTS)]


async def _all_at_once(url: str, model: str, prompts: list[str]) -> list:
    """Half the requests stream, half do not: both paths run under pressure."""
    async with httpx.AsyncClient(timeout=120) as http:

        async def one(i: int, prompt: str) -> str:
            body = completion_body(model, prompt, MAX_TOKENS)
            if i % 2 == 0:
                result = await stream_sse(http, url, body)
                assert result.error is None and result.done, result
                return result.text
            response = await http.post(f"{url}/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def test_outputs_under_preemption_equal_unpressured(
    pressure_server: ServerProcess, model_name: str, figures: dict
) -> None:
    url = pressure_server.url
    prompts = _prompts()
    start = time.monotonic()
    expected = greedy_alone(url, model_name, prompts, MAX_TOKENS)
    alone_s = time.monotonic() - start
    alone_preemptions = metric_value(url, PREEMPTIONS)
    assert alone_preemptions == 0, "a request alone must fit the pool"

    start = time.monotonic()
    assert asyncio.run(_all_at_once(url, model_name, prompts)) == expected
    together_s = time.monotonic() - start
    preemptions = metric_value(url, PREEMPTIONS) - alone_preemptions
    wait_idle(url, timeout=10.0)
    figures["KV pressure: requests / preemptions / outputs equal to unpressured"] = (
        f"{NUM_REQUESTS} / {preemptions:.0f} / {NUM_REQUESTS} (pool of "
        f"{PRESSURE_NUM_BLOCKS - 1} blocks x {PRESSURE_BLOCK_SIZE} tokens, {MAX_TOKENS} tokens "
        f"each; {alone_s:.1f} s one at a time, {together_s:.1f} s together)"
    )
    assert preemptions >= MIN_PREEMPTIONS
