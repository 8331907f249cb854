"""``hermes``: Qwen2.5, Qwen3 and Hermes models. Each call is a JSON object between tags,
``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``; the text before the first
call is the content. A last call whose closing tag was cut off still counts once its object is
complete."""

from __future__ import annotations

from pagedserve.entrypoints.openai.tool_parsers.base import (
    MarkedToolParser,
    PartialCall,
    read_call,
)
from pagedserve.entrypoints.openai.tool_parsers.json_scan import MalformedJSON, skip_whitespace

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(MarkedToolParser):
    marker = START

    def calls_from(self, text: str, marker: int) -> list[PartialCall]:
        """Text after the last call is ignored."""
        calls: list[PartialCall] = []
        i = marker
        while text.startswith(START, i):
            start = skip_whitespace(text, i + len(START))
            if start == len(text):
                break
            call, end = read_call(text, start, ("arguments", "parameters"))
            calls.append(call)
            if end is None:
                break
            close = skip_whitespace(text, end)
            if not text.startswith(END, close):
                if END.startswith(text[close:]):
                    break  # the closing tag is still being written
                raise MalformedJSON(f"expected {END} at {close}")
            i = skip_whitespace(text, close + len(END))
        return calls
