"""``mistral``: Mistral models' ``[TOOL_CALLS]`` followed by a JSON array of
``{"name": "f", "arguments": {...}}``; the text before it is the content. Mistral's chat
templates want tool-call ids of 9 letters and digits: this parser makes such ids."""

from __future__ import annotations

import secrets
import string

from pagedserve.entrypoints.openai.tool_parsers.base import (
    MarkedToolParser,
    PartialCall,
    read_call_array,
)
from pagedserve.entrypoints.openai.tool_parsers.json_scan import skip_whitespace

TOOL_CALLS = "[TOOL_CALLS]"
_ID_CHARS = string.ascii_letters + string.digits


class MistralToolParser(MarkedToolParser):
    marker = TOOL_CALLS

    def calls_from(self, text: str, marker: int) -> list[PartialCall]:
        start = skip_whitespace(text, marker + len(TOOL_CALLS))
        if start == len(text):
            return []
        return read_call_array(text, start, ("arguments",))[0]

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
