"""``llama3_json``: Llama 3.1, 3.2 and 3.3 with JSON tool calls. The whole output is the calls:
``{"name": "f", "parameters": {...}}`` (``arguments`` is accepted too), optionally after
``<|python_tag|>``, several separated by ``;``. An output that does not start that way is
content."""

from __future__ import annotations

from pagedserve.entrypoints.openai.tool_parsers.base import (
    ParsedCalls,
    PartialCall,
    ToolParser,
    read_call,
    whole_output,
)
from pagedserve.entrypoints.openai.tool_parsers.json_scan import MalformedJSON, skip_whitespace

PYTHON_TAG = "<|python_tag|>"
_KEYS = ("parameters", "arguments")


def _start(text: str) -> int | None:
    """Where the first call object starts (len(text) when nothing but a possible start has
    been written yet); None when the output is plain content."""
    i = skip_whitespace(text, 0)
    if text.startswith(PYTHON_TAG, i):
        i = skip_whitespace(text, i + len(PYTHON_TAG))
    if text.startswith("{", i):
        return i
    rest = text[i:]
    return len(text) if PYTHON_TAG.startswith(rest) else None


def _calls(text: str, start: int) -> list[PartialCall]:
    calls: list[PartialCall] = []
    i = start
    while i < len(text):
        call, end = read_call(text, i, _KEYS)
        calls.append(call)
        if end is None:
            break
        i = skip_whitespace(text, end)
        if i < len(text) and text[i] != ";":
            raise MalformedJSON(f"expected ';' at {i}")
        i = skip_whitespace(text, i + 1)
    return calls


class Llama3JsonToolParser(ToolParser):
    def parse(self, text: str) -> ParsedCalls:
        start = _start(text)
        if start is None:
            return ParsedCalls(text or None)
        try:
            calls = _calls(text, start)
        except MalformedJSON:
            calls = []
        return whole_output(calls, "", text)

    def parse_partial(self, text: str) -> ParsedCalls:
        start = _start(text)
        if start is None:
            return ParsedCalls(text)
        try:
            return ParsedCalls("", _calls(text, start))
        except MalformedJSON:
            return ParsedCalls("")
