"""Helpers of the reliability tests: server processes started together, reading ``/metrics``
and process memory, greedy references, and streaming clients that can leave mid-stream."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.entrypoints.openai.server_utils import ServerProcess, metric_value

RUNNING = "pagedserve:num_requests_running"
WAITING = "pagedserve:num_requests_waiting"
KV_USAGE = "pagedserve:kv_cache_usage_perc"
PREEMPTIONS = "pagedserve:num_preemptions_total"


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise KeyError(f"VmRSS not in /proc/{pid}/status")


def engine_state(url: str) -> tuple[float, float, float]:
    """(running, waiting, KV usage) from ``/metrics``."""
    return metric_value(url, RUNNING), metric_value(url, WAITING), metric_value(url, KV_USAGE)


def wait_idle(url: str, timeout: float) -> float:
    """Seconds until ``/metrics`` shows no running or waiting request and no KV block in use;
    fails after ``timeout`` s."""
    start = time.monotonic()
    while True:
        state = engine_state(url)
        elapsed = time.monotonic() - start
        if state == (0.0, 0.0, 0.0):
            return elapsed
        assert elapsed < timeout, f"after {elapsed:.1f} s: running, waiting, kv usage = {state}"
        time.sleep(0.05)


def completion_body(model: str, prompt: str | list[int], max_tokens: int, **extra: object) -> dict:
    """A greedy completion that runs exactly ``max_tokens`` tokens."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        **extra,
    }


def greedy_alone(url: str, model: str, prompts: list, max_tokens: int) -> list[str]:
    """Each prompt's greedy text, requested one at a time (nothing else runs meanwhile)."""
    texts = []
    with httpx.Client(timeout=60) as http:
        for prompt in prompts:
            r = http.post(f"{url}/v1/completions", json=completion_body(model, prompt, max_tokens))
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
    return texts


@dataclass
class StreamResult:
    text: str = ""
    events: list[dict] = field(default_factory=list)
    event_times: list[float] = field(default_factory=list)
    """``time.monotonic()`` at which each event arrived."""
    error: dict | None = None
    """The ``error`` of an error event, if the stream ended with one."""
    done: bool = False
    """``data: [DONE]`` arrived."""
    status: int | None = None
    left: bool = False
    """The client went away on purpose before the end."""
    usage: dict | None = None


def _apply_event(result: StreamResult, line: str) -> None:
    if line == "data: [DONE]":
        result.done = True
        return
    event = json.loads(line.removeprefix("data: "))
    result.events.append(event)
    result.event_times.append(time.monotonic())
    if "error" in event:
        result.error = event["error"]
        return
    if event.get("usage"):
        result.usage = event["usage"]
    for choice in event.get("choices", []):
        result.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def stream_sse(
    http: httpx.AsyncClient,
    url: str,
    body: dict,
    leave_after_events: int | None = None,
    path: str = "/v1/completions",
    result: StreamResult | None = None,
) -> StreamResult:
    """POST a streaming request and read its events (into ``result`` as they arrive, if given,
    so others can watch); with ``leave_after_events``, close the connection after that many
    data events (a client going away mid-stream)."""
    result = StreamResult() if result is None else result
    async with http.stream("POST", f"{url}{path}", json={**body, "stream": True}) as response:
        result.status = response.status_code
        if response.status_code != 200:
            result.error = json.loads(await response.aread())["error"]
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if leave_after_events is not None and len(result.events) >= leave_after_events:
                result.left = True
                return result  # leaving the block closes the connection
            _apply_event(result, line)
    return result


async def leave_after_delay(coro: asyncio.Future, delay: float) -> None:
    """Cancel a client's request after ``delay`` s (wherever it is: connecting, waiting for
    headers, or streaming): the connection closes."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=delay)
    if not done:
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def start_servers(
    model_dir: Path, log_dir: Path, configs: dict[str, tuple[str, ...]],
    envs: Mapping[str, Mapping[str, str]],
) -> dict[str, ServerProcess]:
    """Start several servers at once (their start-ups overlap); wait with ``wait_ready``.
    ``configs``: name -> options; ``envs``: name -> environment variables (where any)."""
    return {
        name: ServerProcess(model_dir, log_dir / f"{name}.log", *args, env=envs.get(name))
        for name, args in configs.items()
    }
