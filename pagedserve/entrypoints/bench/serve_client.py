"""One streaming request of ``bench serve``, timed: TTFT (to the first chunk with tokens), the
gaps between later such chunks (ITL), the end-to-end latency, and the server's token counts
(``stream_options.include_usage``).

Any OpenAI-compatible server works: the completions or the chat completions API, SSE framing.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from pagedserve.entrypoints.bench.serve_dataset import SampleRequest

Endpoint = Literal["completions", "chat"]
ENDPOINT_PATHS: dict[str, str] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}


@dataclass
class RequestResult:
    prompt_len: int
    """The server's count when it reports usage, else the generated length."""
    success: bool = False
    error: str = ""
    output_len: int = 0
    start: float = 0.0
    """``time.perf_counter()`` when the request was sent."""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    model: str = ""
    """The served model (or LoRA adapter) the request named."""


def request_body(
    endpoint: Endpoint, model: str, sample: SampleRequest, sampling: dict[str, Any]
) -> dict[str, Any]:
    """A streaming request that asks for ``sample.output_len`` tokens and the usage chunk."""
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        **sampling,
    }
    if endpoint == "completions":
        return {**body, "prompt": sample.prompt, "max_tokens": sample.output_len}
    if not isinstance(sample.prompt, str):
        raise ValueError("prompt_kind: the chat API takes text prompts, not token ids")
    messages = [{"role": "user", "content": sample.prompt}]
    return {**body, "messages": messages, "max_completion_tokens": sample.output_len}


def _carries_tokens(event: dict[str, Any]) -> bool:
    """A chunk with new text, or the last one (its finish reason): not the usage chunk, nor
    the chat API's first chunk (the assistant role, before any token)."""
    for choice in event.get("choices") or []:
        text = choice.get("text") or (choice.get("delta") or {}).get("content")
        if text or choice.get("finish_reason") is not None:
            return True
    return False


class _Timing:
    """Arrival times of the chunks of one stream that carry tokens."""

    def __init__(self, result: RequestResult) -> None:
        self.result = result
        self.last: float | None = None

    def on_event(self, event: dict[str, Any]) -> None:
        result = self.result
        if "error" in event:
            raise RuntimeError(f"error event: {event['error'].get('message', event['error'])}")
        usage = event.get("usage")
        if usage:
            result.prompt_len = usage.get("prompt_tokens", result.prompt_len)
            result.output_len = usage.get("completion_tokens", result.output_len)
        if not _carries_tokens(event):
            return
        now = time.perf_counter()
        if self.last is None:
            result.ttft = now - result.start
        else:
            result.itl.append(now - self.last)
        self.last = now


async def send_request(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], prompt_len: int
) -> RequestResult:
    """POST one streaming request to ``url`` and time it; failures are recorded, not raised."""
    result = RequestResult(prompt_len=prompt_len, start=time.perf_counter(),
                           model=str(body.get("model", "")))
    timing = _Timing(result)
    try:
        async with http.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status_code}: {text[:300]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                timing.on_event(json.loads(data))
        result.latency = time.perf_counter() - result.start
        if timing.last is None:
            raise RuntimeError("the stream ended without any chunk")
        if result.output_len == 0:  # a server without usage chunks: count the chunks
            result.output_len = len(result.itl) + 1
        result.success = True
    except (httpx.HTTPError, RuntimeError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result
