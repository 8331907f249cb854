"""``POST /v1/responses`` (OpenAI's Responses API): the request body, and its translation into
the chat completions request that serves it.

A response is a chat completion in other clothes: ``instructions`` is a system message,
``input`` the conversation (text, earlier function calls and their outputs), ``tools`` are
function tools, ``text.format`` is ``response_format``. Nothing is stored, so ``store`` is
false (or left out) and there is no ``previous_response_id``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pagedserve.entrypoints.openai.tools_protocol import FUNCTION_NAME
from pagedserve.entrypoints.openai.unsupported_fields import RequestBody

INPUT_ROLES = ("user", "assistant", "system", "developer")
CHAT_TO_RESPONSES_PARAM = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}
"""A chat request's field -> the Responses field it came from (for the 400's ``param``)."""


class FunctionTool(RequestBody):
    type: Literal["function"]
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(RequestBody):
    type: Literal["function"]
    name: str


class TextFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(RequestBody):
    format: TextFormat | None = None


class ResponsesRequest(RequestBody):
    """The fields this server implements; any other is a 400 naming it."""

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(
        ..., description="Text, or a list of items: messages (input_text / output_text parts), "
        "function_call and function_call_output.")
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    stream: bool = False
    store: bool | None = Field(None, description="Responses are not stored: false or absent.")
    metadata: dict[str, str] | None = Field(None, description="Returned with the response.")
    user: str | None = None

    def chat_body(self) -> dict[str, Any]:
        """The chat completions request (a dict for ``ChatCompletionRequest``) that serves
        this one; ``ValueError`` naming the Responses field for an input it cannot hold."""
        if self.store:
            raise ValueError("store: responses are not stored on this server; send false")
        body: dict[str, Any] = {"messages": self._messages(), "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        for name in ("model", "temperature", "top_p", "parallel_tool_calls", "user"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(
                exclude={"type"}, exclude_none=True)} for t in self.tools]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type != "text":
            body["response_format"] = _response_format(fmt)
        return body

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            _add_item(messages, f"input[{i}]", item)
        return messages


def _response_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None or fmt.name is None:
        raise ValueError("text.format: a json_schema format needs name and schema")
    schema: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
    if fmt.description is not None:
        schema["description"] = fmt.description
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": schema}


def _add_item(messages: list[dict[str, Any]], where: str, item: dict[str, Any]) -> None:
    """Append one input item as chat messages; consecutive function calls make one assistant
    turn with several tool calls."""
    kind = item.get("type", "message")
    if kind == "message":
        messages.append({"role": _role(where, item), "content": _text(where, item.get("content"))})
    elif kind == "function_call":
        call = {"id": _string(where, item, "call_id"), "type": "function", "function": {
            "name": _string(where, item, "name"), "arguments": _string(where, item, "arguments")}}
        last = messages[-1] if messages else None
        if last and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
            last["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": _string(where, item, "call_id"),
                         "content": _string(where, item, "output")})
    else:
        raise ValueError(f"{where}.type: {kind!r} is not supported (message, function_call, "
                         "function_call_output)")


def _role(where: str, item: dict[str, Any]) -> str:
    role = item.get("role")
    if role not in INPUT_ROLES:
        raise ValueError(f"{where}.role: expected one of {', '.join(INPUT_ROLES)}, got {role!r}")
    return str(role)


def _string(where: str, item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{where}.{key}: expected a string, got {value!r}")
    return value


def _text(where: str, content: Any) -> str:
    """A message's content: a string, or text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content: expected a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}.content[{j}]: only input_text and output_text parts "
                             f"are supported, got {kind!r}")
        texts.append(part["text"])
    return "".join(texts)
