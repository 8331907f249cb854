"""Tool-call parsers, by their ``--tool-call-parser`` name (vLLM's names)."""

from __future__ import annotations

from pagedserve.entrypoints.openai.tool_parsers.base import ParsedCalls, PartialCall, ToolParser
from pagedserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedserve.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedserve.entrypoints.openai.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}

__all__ = ["TOOL_PARSERS", "ParsedCalls", "PartialCall", "ToolParser"]
