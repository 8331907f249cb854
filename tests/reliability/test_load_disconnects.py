"""Load: 200 concurrent streaming clients, 30% of them going away at random points. Every client
that stays gets exactly the greedy text its prompt gets alone; afterwards the engine is idle
with no KV block in use, and the server's memory has not grown past where it was after
warm-up."""

from __future__ import annotations

import asyncio
import gc
import random
import time
from dataclasses import dataclass

import httpx
import pytest

from tests.entrypoints.openai.server_utils import ServerProcess
from tests.reliability.reliability_utils import (
    StreamResult,
    completion_body,
    greedy_alone,
    leave_after_delay,
    rss_bytes,
    stream_sse,
    wait_idle,
)

pytestmark = pytest.mark.serial  # resident memory before and after the load

NUM_CLIENTS = 200
LEAVING_FRACTION = 0.3
NUM_PROMPTS = 20
MAX_TOKENS = 12
WARMUP_CLIENTS = 40
MAX_RSS_GROWTH = 0.10
WORDS = ["apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "ember", "brown", "quick"]


@dataclass(frozen=True)
class Client:
    prompt_index: int
    leave_after_events: int | None = None
    """Close the connection after this many data events."""
    leave_after_s: float | None = None
    """Cancel the request after this long (possibly before any byte came back)."""

    @property
    def stays(self) -> bool:
        return self.leave_after_events is None and self.leave_after_s is None


def _prompts() -> list[str]:
    return [f"{WORDS[i % 10]} {WORDS[(3 * i + 1) % 10]} number {i}" for i in range(NUM_PROMPTS)]


def _clients(num_clients: int, rng: random.Random) -> list[Client]:
    """Prompts in turn; ``LEAVING_FRACTION`` of the clients leave, half of them after a random
    number of events, half after a random delay."""
    leaving = set(rng.sample(range(num_clients), round(num_clients * LEAVING_FRACTION)))
    clients = []
    for i in range(num_clients):
        prompt_index = i % NUM_PROMPTS
        if i not in leaving:
            clients.append(Client(prompt_index))
        elif rng.random() < 0.5:
            clients.append(Client(prompt_index, leave_after_events=rng.randrange(MAX_TOKENS)))
        else:
            clients.append(Client(prompt_index, leave_after_s=rng.uniform(0.0, 0.5)))
    return clients


async def _run(url: str, model: str, prompts: list[str], clients: list[Client]) -> list:
    """Every client at once; the staying clients' results (None for those that left)."""
    limits = httpx.Limits(max_connections=len(clients) + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:

        async def one(client: Client) -> StreamResult | None:
            body = completion_body(
                model,
                prompts[client.prompt_index],
                MAX_TOKENS,
                stream_options={"include_usage": True},
            )
            stream = stream_sse(http, url, body, client.leave_after_events)
            if client.leave_after_s is not None:
                await leave_after_delay(stream, client.leave_after_s)
                return None
            return await stream

        return await asyncio.gather(*(one(c) for c in clients))


def _check_stayers(clients: list[Client], results: list, expected: list[str]) -> int:
    ok = 0
    for client, result in zip(clients, results, strict=True):
        if not client.stays:
            continue
        assert result.status == 200 and result.error is None and result.done, result
        assert result.text == expected[client.prompt_index]
        assert result.usage["completion_tokens"] == MAX_TOKENS
        ok += 1
    return ok


def _memory(server: ServerProcess) -> tuple[int, int]:
    gc.collect()
    time.sleep(0.5)  # let the server's last aborts and frees land
    return rss_bytes(server.proc.pid), rss_bytes(server.engine_pid())


def test_200_streams_with_30_percent_leaving(
    main_server: ServerProcess, model_name: str, figures: dict
) -> None:
    url = main_server.url
    prompts = _prompts()
    expected = greedy_alone(url, model_name, prompts, MAX_TOKENS)
    assert len(set(expected)) > NUM_PROMPTS // 2, "prompts should give distinct continuations"
    rng = random.Random(0)

    warmup = _clients(WARMUP_CLIENTS, rng)
    _check_stayers(warmup, asyncio.run(_run(url, model_name, prompts, warmup)), expected)
    wait_idle(url, timeout=10.0)
    api_before, engine_before = _memory(main_server)

    clients = _clients(NUM_CLIENTS, rng)
    start = time.monotonic()
    results = asyncio.run(_run(url, model_name, prompts, clients))
    load_s = time.monotonic() - start
    stayed = _check_stayers(clients, results, expected)
    idle_after_s = wait_idle(url, timeout=10.0)
    api_after, engine_after = _memory(main_server)

    figures["load: clients / stayed and exact / left"] = (
        f"{NUM_CLIENTS} / {stayed} / {NUM_CLIENTS - stayed} in {load_s:.1f} s "
        f"({MAX_TOKENS} tokens each); idle with KV usage 0.0 {idle_after_s:.2f} s later"
    )
    figures["load: RSS after warm-up -> after load (API, engine)"] = (
        f"{api_before / 2**20:.0f} -> {api_after / 2**20:.0f} MiB, "
        f"{engine_before / 2**20:.0f} -> {engine_after / 2**20:.0f} MiB"
    )
    assert stayed == NUM_CLIENTS - round(NUM_CLIENTS * LEAVING_FRACTION)
    # Growth is what a leak would show; RSS may also fall, when memory an earlier test of this
    # server touched (huge prompts) goes back to the system during the load.
    assert api_after - api_before <= MAX_RSS_GROWTH * api_before
    assert engine_after - engine_before <= MAX_RSS_GROWTH * engine_before
