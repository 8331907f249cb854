"""``POST /v1/responses``: the chat completions handler serves the request (responses_protocol
translates it); its result is re-dressed as a Response object, or its stream of chunks as the
Responses API's typed events (``response.created``, ``response.output_text.delta``, ...,
``response.completed``). Output items: ``reasoning`` (with a ``--reasoning-parser``),
``message`` and one ``function_call`` per tool call, in the order the model wrote them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from pagedserve.entrypoints.openai.errors import OpenAIError, validation_error
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest
from pagedserve.entrypoints.openai.responses import now
from pagedserve.entrypoints.openai.responses_protocol import (
    CHAT_TO_RESPONSES_PARAM,
    ResponsesRequest,
)
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_common import engine_errors


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _renamed(err: OpenAIError) -> OpenAIError:
    """The chat handler's error, its ``param`` named as the Responses request names it."""
    if err.param:
        head, dot, rest = err.param.partition(".")
        head, sep, index = head.partition("[")
        if head in CHAT_TO_RESPONSES_PARAM:
            name = CHAT_TO_RESPONSES_PARAM[head]
            err.param = name + sep + index + dot + rest
            err.message = err.message.replace(head, name)
    return err


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_response(self, request: ResponsesRequest, raw: Request) -> Response:
        try:
            with engine_errors():
                chat_request = ChatCompletionRequest.model_validate(request.chat_body())
            answer = await self.chat.create_chat_completion(chat_request, raw)
        except ValidationError as e:
            errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]
            raise _renamed(validation_error(RequestValidationError(errors))) from None
        except OpenAIError as e:
            raise _renamed(e) from None
        shell = ResponseShell(request, _id("resp"), now())
        if isinstance(answer, StreamingResponse):
            return StreamingResponse(_events(shell, answer), media_type="text/event-stream")
        if not isinstance(answer, JSONResponse):
            return answer
        return JSONResponse(shell.from_chat(json.loads(bytes(answer.body))))


@dataclass
class ResponseShell:
    """The Response object around the output: the request's settings, echoed as OpenAI does."""

    request: ResponsesRequest
    id: str
    created_at: int

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
             model: str | None = None) -> dict[str, Any]:
        r = self.request
        text = r.text.model_dump(by_alias=True, exclude_none=True) if r.text else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "model": model or r.model, "output": output, "usage": usage,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "temperature": r.temperature, "top_p": r.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or []],
            "tool_choice": (r.tool_choice or ("auto" if r.tools else "none"))
            if isinstance(r.tool_choice, str | None) else r.tool_choice.model_dump(),
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "text": text or {"format": {"type": "text"}}, "metadata": r.metadata or {},
            "store": False, "user": r.user,
        }

    def from_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed chat completion as a Response."""
        choice = chat["choices"][0]
        message = choice["message"]
        output = []
        if message.get("reasoning_content"):
            output.append(reasoning_item(_id("rs"), message["reasoning_content"]))
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            output.append(message_item(_id("msg"), message.get("content") or "", "completed"))
        output += [function_call_item(_id("fc"), c["id"], c["function"]["name"],
                                      c["function"]["arguments"], "completed") for c in calls]
        return self.body(_status(choice["finish_reason"]), output, usage(chat["usage"]),
                         chat["model"])


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status != (
        "in_progress") else []
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": content}


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                       status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


# -- streaming ---------------------------------------------------------------------------------


@dataclass
class _OpenItem:
    kind: str
    """``message``, ``reasoning`` or ``function_call``."""
    id: str
    index: int
    """Its position in the response's output."""
    text: str = ""
    call_id: str = ""
    name: str = ""
    tool_index: int = -1


@dataclass
class _EventWriter:
    """The Responses API's events, each with the next ``sequence_number``; the output items
    opened and closed as the chat deltas change kind."""

    shell: ResponseShell
    sequence: int = 0
    output: list[dict[str, Any]] = field(default_factory=list)
    open: _OpenItem | None = None

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def delta(self, kind: str, text: str, tool: dict[str, Any] | None = None) -> list[str]:
        """Events for a piece of ``kind`` output (for a tool call, its chat delta)."""
        events: list[str] = []
        item = self.open
        new_call = tool is not None and (item is None or item.tool_index != tool["index"])
        if item is None or item.kind != kind or new_call:
            events += self.close()
            item = self.open = self._start(kind, tool)
            events += self._added(item)
        if not text:
            return events
        item.text += text
        where = {"item_id": item.id, "output_index": item.index}
        if kind == "message":
            events.append(self.event("response.output_text.delta", **where, content_index=0,
                                     delta=text, logprobs=[]))
        elif kind == "reasoning":
            events.append(self.event("response.reasoning_text.delta", **where, content_index=0,
                                     delta=text))
        else:
            events.append(self.event("response.function_call_arguments.delta", **where,
                                     delta=text))
        return events

    def _start(self, kind: str, tool: dict[str, Any] | None) -> _OpenItem:
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind]
        item = _OpenItem(kind, _id(prefix), len(self.output))
        if tool is not None:
            item.tool_index = tool["index"]
            item.call_id = tool.get("id") or _id("call")
            item.name = (tool.get("function") or {}).get("name") or ""
        return item

    def _item(self, item: _OpenItem, status: str) -> dict[str, Any]:
        if item.kind == "message":
            return message_item(item.id, item.text, status)
        if item.kind == "reasoning":
            return reasoning_item(item.id, item.text)
        return function_call_item(item.id, item.call_id, item.name, item.text, status)

    def _added(self, item: _OpenItem) -> list[str]:
        events = [self.event("response.output_item.added", output_index=item.index,
                             item=self._item(item, "in_progress"))]
        if item.kind == "message":
            events.append(self.event(
                "response.content_part.added", item_id=item.id, output_index=item.index,
                content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def close(self) -> list[str]:
        """The done events of the open item, which joins the output."""
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item.id, "output_index": item.index}
        events = []
        if item.kind == "message":
            part = {"type": "output_text", "text": item.text, "annotations": []}
            events += [self.event("response.output_text.done", **where, content_index=0,
                                  text=item.text, logprobs=[]),
                       self.event("response.content_part.done", **where, content_index=0,
                                  part=part)]
        elif item.kind == "reasoning":
            events.append(self.event("response.reasoning_text.done", **where, content_index=0,
                                     text=item.text))
        else:
            events.append(self.event("response.function_call_arguments.done", **where,
                                     name=item.name, arguments=item.text))
        done = self._item(item, "completed")
        self.output.append(done)
        events.append(self.event("response.output_item.done", output_index=item.index,
                                 item=done))
        return events


async def _events(shell: ResponseShell, chat: StreamingResponse) -> AsyncIterator[str]:
    """The chat handler's chunks (``data: {...}`` events) as the Responses API's events."""
    writer = _EventWriter(shell)
    started = shell.body("in_progress", [], None)
    yield writer.event("response.created", response=started)
    yield writer.event("response.in_progress", response=started)
    finish_reason, chat_usage, model = None, None, None
    chunks = chat.body_iterator
    try:
        async for raw in chunks:
            text = raw if isinstance(raw, str) else bytes(raw).decode()
            for line in text.splitlines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    error = chunk["error"]
                    yield writer.event("error", code=error.get("code"),
                                       message=error["message"], param=error.get("param"))
                    return
                model = chunk.get("model", model)
                chat_usage = chunk.get("usage") or chat_usage
                for choice in chunk["choices"]:
                    for event in _choice_events(writer, choice["delta"]):
                        yield event
                    finish_reason = choice.get("finish_reason") or finish_reason
    finally:
        # A client that leaves closes this generator: close the chat stream now, so its
        # request is aborted at once rather than when the generator is collected.
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()
    if writer.open is None and not writer.output:
        for event in writer.delta("message", ""):  # an empty reply is one empty message
            yield event
    for event in writer.close():
        yield event
    status = _status(finish_reason)
    done = shell.body(status, writer.output, usage(chat_usage), model)
    yield writer.event(f"response.{status}", response=done)


def _choice_events(writer: _EventWriter, delta: dict[str, Any]) -> list[str]:
    events: list[str] = []
    if delta.get("reasoning_content"):
        events += writer.delta("reasoning", delta["reasoning_content"])
    if delta.get("content"):
        events += writer.delta("message", delta["content"])
    for call in delta.get("tool_calls") or []:
        arguments = (call.get("function") or {}).get("arguments") or ""
        events += writer.delta("function_call", arguments, call)
    return events
