"""What the completion and chat handlers share: engine errors as HTTP errors, SSE framing,
waiting on client disconnects, and merging several request streams (model names:
``serving_models``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from pagedserve.engine.async_llm import (
    AsyncLLM,
    EngineNotReadyError,
    EngineOverloadedError,
    RequestStream,
    RequestTimeoutError,
    ServerShuttingDownError,
)
from pagedserve.engine.core_proc import EngineDeadError
from pagedserve.engine.input_processor import ProcessedRequest
from pagedserve.entrypoints.openai.errors import OpenAIError, bad_request, param_from_message
from pagedserve.entrypoints.openai.logprobs import TokenText, decoded_text, id_text
from pagedserve.entrypoints.openai.protocol import SamplingFields
from pagedserve.entrypoints.openai.responses import random_id
from pagedserve.outputs import RequestOutput, RequestOutputKind

logger = logging.getLogger(__name__)

RETRY_AFTER_S = "1"
CLIENT_CLOSED_REQUEST = 499
"""nginx's status for a request whose client went away (never seen by that client)."""


_API_FIELDS = {"prompt_token_ids": "prompt"}
"""Engine field names in validation messages -> the request field the client sent."""


def to_openai_error(
    exc: BaseException, field_names: dict[str, str] | None = None
) -> OpenAIError | None:
    """The HTTP error for an engine-side failure, or None for an exception that is a bug.
    ``field_names``: engine field -> the request field the client sent (for this request)."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineNotReadyError):
        return OpenAIError(
            HTTPStatus.SERVICE_UNAVAILABLE,
            str(exc),
            code="engine_starting",
            headers={"Retry-After": RETRY_AFTER_S},
        )
    if isinstance(exc, EngineOverloadedError):
        return OpenAIError(
            HTTPStatus.SERVICE_UNAVAILABLE,
            str(exc),
            code="server_overloaded",
            headers={"Retry-After": RETRY_AFTER_S},
        )
    if isinstance(exc, ServerShuttingDownError):
        return OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), code="server_shutting_down")
    if isinstance(exc, RequestTimeoutError):
        return OpenAIError(
            HTTPStatus.REQUEST_TIMEOUT, str(exc), param="timeout", code="request_timeout"
        )
    if isinstance(exc, EngineDeadError):
        return OpenAIError(
            HTTPStatus.SERVICE_UNAVAILABLE, f"the engine is not running: {exc}", code="engine_dead"
        )
    if isinstance(exc, ValueError):
        names = {**_API_FIELDS, **(field_names or {})}
        message = str(exc)
        for engine_name, api_name in (field_names or {}).items():
            message = re.sub(rf"\b{engine_name}\b", api_name, message)
        code = "context_length_exceeded" if "max_model_len" in message else "invalid_value"
        param = param_from_message(str(exc))
        field = None if param is None else names.get(param, param)
        return bad_request(message, param=field, code=code)
    return None


def logprob_token_text(request: SamplingFields, tokenizer: Any) -> TokenText:
    """How the request's logprobs name tokens (``return_tokens_as_token_ids``)."""
    return id_text if request.return_tokens_as_token_ids else decoded_text(tokenizer)


def with_cache_salt(request: SamplingFields, prompt: Any) -> Any:
    """The engine prompt with the request's ``cache_salt`` (a dict prompt, as vLLM's)."""
    if request.cache_salt is None:
        return prompt
    if isinstance(prompt, dict):
        return {**prompt, "cache_salt": request.cache_salt}
    key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
    return {key: prompt, "cache_salt": request.cache_salt}


@contextlib.contextmanager
def engine_errors(field_names: dict[str, str] | None = None) -> Iterator[None]:
    """Re-raise engine and validation failures as ``OpenAIError`` (``field_names``: see
    ``to_openai_error``)."""
    try:
        yield
    except Exception as exc:
        err = to_openai_error(exc, field_names)
        if err is None or err is exc:
            raise
        raise err from exc


def sse(payload: BaseModel | dict) -> str:
    """One server-sent event carrying a JSON payload."""
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def stream_error(exc: Exception) -> dict:
    """An error after a streaming response started: sent as an SSE event in OpenAI's shape."""
    err = to_openai_error(exc)
    if err is None:
        logger.error("streaming request failed", exc_info=exc)
        err = OpenAIError(500, f"internal error: {exc!r}", code="internal_error")
    return err.body()


@dataclass(frozen=True)
class RequestIds:
    """A request's id in its response, and the base of its engine requests' ids."""

    response: str
    engine: str

    @classmethod
    def of(cls, prefix: str, raw: Request, given: str | None) -> RequestIds:
        """vLLM's: the client's ``X-Request-Id`` header, else the body's ``request_id``, after
        ``prefix``; else a random id. The engine's ids get a random suffix, so a client that
        repeats its id while the first request runs does not collide with it."""
        given = raw.headers.get("x-request-id") or given
        if not given:
            random = random_id(prefix)
            return cls(random, random)
        response = f"{prefix}-{given}"
        return cls(response, f"{response}-{uuid.uuid4().hex[:12]}")


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index of the stream, output) from several streams, as the outputs arrive."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    output = fut.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, output
    finally:
        for fut in pending:
            fut.cancel()


async def last_output(stream: RequestStream) -> RequestOutput:
    """The final output of a stream submitted with ``RequestOutputKind.FINAL_ONLY``."""
    final: RequestOutput | None = None
    async for output in stream:
        final = output
    if final is None:
        raise EngineDeadError("the request ended without an output")
    return final


async def cancel_on_disconnect(raw: Request, work: Awaitable[Response]) -> Response:
    """Run a non-streaming handler, cancelling it (so its requests are aborted) as soon as the
    client disconnects. The body has been read already, so ``receive`` waits for the
    disconnect message."""
    handler = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not handler.done():
            handler.cancel()  # its streams close (and abort) as the cancellation unwinds it
    if not handler.done() or handler.cancelled():
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return handler.result()


def close_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.close()


async def submit_all(
    engine: AsyncLLM,
    processed: list[ProcessedRequest],
    output_kind: RequestOutputKind,
    timeout: float | None,
) -> list[RequestStream]:
    """Submit processed requests (each with the client's ``timeout``, None: none); on a
    failure, abort the ones already submitted."""
    streams: list[RequestStream] = []
    try:
        for item in processed:
            streams.append(await engine.submit(item, output_kind, timeout))
    except BaseException:
        close_all(streams)
        raise
    return streams
