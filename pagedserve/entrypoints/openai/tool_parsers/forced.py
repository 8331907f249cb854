"""The outputs of constrained tool choices (``tool_choice`` ``"required"`` or a named function):
decoding followed a JSON schema, so the output is the calls themselves, in one shape:

- a named function: the output is its arguments object;
- ``"required"``: a JSON array of ``{"name": ..., "parameters": {...}}``, one item per call
  (vLLM's shape), ``required_schema`` below.
"""

from __future__ import annotations

from typing import Any

from pagedserve.entrypoints.openai.tool_parsers.base import (
    ParsedCalls,
    PartialCall,
    ToolParser,
    read_call_array,
)
from pagedserve.entrypoints.openai.tool_parsers.json_scan import MalformedJSON, skip_whitespace

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
"""The schema of a function declared without ``parameters``."""


def required_schema(functions: list[tuple[str, dict[str, Any] | None]],
                    max_calls: int | None) -> dict[str, Any]:
    """The JSON schema of one or more calls of the (name, parameters schema) ``functions``."""
    items = [
        {"type": "object",
         "properties": {"name": {"type": "string", "enum": [name]},
                        "parameters": parameters or EMPTY_PARAMETERS},
         "required": ["name", "parameters"], "additionalProperties": False}
        for name, parameters in functions
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema


class NamedFunctionOutput(ToolParser):
    """The whole output is the arguments of the function ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str) -> ParsedCalls:
        return ParsedCalls(None, [PartialCall(self.name, text.strip(), complete=True)])

    def parse_partial(self, text: str) -> ParsedCalls:
        return ParsedCalls(None, [PartialCall(self.name, text.strip())])


class RequiredCallsOutput(ToolParser):
    """The whole output is ``required_schema``'s array of calls. An output cut off by
    ``max_tokens`` keeps its finished calls (the finish reason says ``length``); with none, its
    text is the content."""

    def parse(self, text: str) -> ParsedCalls:
        try:
            calls, _ = read_call_array(text, skip_whitespace(text, 0), ("parameters",))
        except MalformedJSON:
            calls = []
        finished = [call for call in calls if call.is_valid()]
        return ParsedCalls(None, finished) if finished else ParsedCalls(text or None)

    def parse_partial(self, text: str) -> ParsedCalls:
        start = skip_whitespace(text, 0)
        if start == len(text):
            return ParsedCalls(None)
        try:
            return ParsedCalls(None, read_call_array(text, start, ("parameters",))[0])
        except MalformedJSON:
            return ParsedCalls(None)
