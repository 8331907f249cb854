"""What every tool parser shares: the calls found in a model's output, read from the whole
output (``parse``) or from the part generated so far (``parse_partial``, for streaming).

``parse_partial`` only ever grows its results as the text grows: its ``content`` is a prefix of
the next one's (text that may still become markup is held back), each call's ``arguments`` a
prefix of the next one's, and a call's ``name`` appears once, whole. The stream sends the
difference between two results. ``parse`` of a malformed output finds no call and gives the
whole text as ``content`` (as vLLM's parsers do in ``"auto"``).
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from pagedserve.entrypoints.openai.tool_parsers.json_scan import (
    MalformedJSON,
    object_members,
    skip_whitespace,
)


@dataclass
class PartialCall:
    """A tool call as far as the output goes: ``name`` None until its string is complete;
    ``arguments`` the JSON text of the arguments so far; ``complete`` once its object closed."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False

    def is_valid(self) -> bool:
        """Complete, named, and its arguments parse as JSON."""
        if not self.complete or self.name is None:
            return False
        try:
            json.loads(self.arguments)
        except ValueError:
            return False
        return True


@dataclass
class ParsedCalls:
    """``content``: the output's text that is not a tool call (None when there is none)."""

    content: str | None
    calls: list[PartialCall] = field(default_factory=list)


def held_back(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that ``marker`` starts with (that much text
    may be the start of the marker, and is not sent yet)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def read_call(text: str, start: int, arguments_keys: tuple[str, ...]) -> tuple[PartialCall,
                                                                               int | None]:
    """The call object at ``text[start]`` (``{"name": ..., <arguments key>: {...}}``) and the
    index past it (None while open); ``MalformedJSON`` when it is not one."""
    if not text.startswith("{", start):
        raise MalformedJSON(f"expected '{{' at {start}")
    members, end = object_members(text, start)
    call = PartialCall(complete=end is not None)
    for member in members:
        stop = len(text) if member.end is None else member.end
        if member.key == "name" and member.end is not None:
            name = json.loads(text[member.start : member.end])
            call.name = name if isinstance(name, str) else None
        elif member.key in arguments_keys:
            call.arguments = text[member.start : stop]
    if end is not None and not call.arguments:
        call.arguments = "{}"  # a call without arguments
    return call, end


def read_call_array(text: str, start: int, arguments_keys: tuple[str, ...]) -> tuple[
        list[PartialCall], int | None]:
    """The calls of a JSON array of call objects whose ``[`` is at ``text[start]``, and the
    index past its ``]`` (None while open)."""
    if not text.startswith("[", start):
        raise MalformedJSON(f"expected '[' at {start}")
    calls: list[PartialCall] = []
    i = skip_whitespace(text, start + 1)
    while i < len(text):
        if text[i] == "]" and not calls:
            return calls, i + 1
        call, end = read_call(text, i, arguments_keys)
        calls.append(call)
        if end is None:
            return calls, None
        i = skip_whitespace(text, end)
        if i < len(text) and text[i] == "]":
            return calls, i + 1
        if i < len(text) and text[i] != ",":
            raise MalformedJSON(f"expected ',' or ']' at {i}")
        i = skip_whitespace(text, i + 1)
    return calls, None


def whole_output(calls: list[PartialCall], content: str, text: str) -> ParsedCalls:
    """``parse``'s answer: the calls and the content, or, when a call is malformed or
    unfinished, no call and the whole text as content. Blank content is None."""
    if calls and all(call.is_valid() for call in calls):
        return ParsedCalls(content if content.strip() else None, calls)
    return ParsedCalls(text or None)


def default_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParser(ABC):
    """One model family's tool-call format (``--tool-call-parser``)."""

    @abstractmethod
    def parse(self, text: str) -> ParsedCalls:
        """The calls in a finished output."""

    @abstractmethod
    def parse_partial(self, text: str) -> ParsedCalls:
        """The calls and the content that is safe to send, from an unfinished output."""

    def new_call_id(self) -> str:
        return default_call_id()


class MarkedToolParser(ToolParser):
    """Calls that start at a marker (``<tool_call>``, ``[TOOL_CALLS]``); the text before the
    first marker is the content."""

    marker: str

    @abstractmethod
    def calls_from(self, text: str, marker: int) -> list[PartialCall]:
        """The calls from the marker at ``marker`` on; ``MalformedJSON`` when they are not."""

    def parse(self, text: str) -> ParsedCalls:
        marker = text.find(self.marker)
        if marker < 0:
            return ParsedCalls(text or None)
        try:
            calls = self.calls_from(text, marker)
        except MalformedJSON:
            calls = []
        return whole_output(calls, text[:marker], text)

    def parse_partial(self, text: str) -> ParsedCalls:
        marker = text.find(self.marker)
        if marker < 0:
            return ParsedCalls(text[: len(text) - held_back(text, self.marker)])
        try:
            return ParsedCalls(text[:marker], self.calls_from(text, marker))
        except MalformedJSON:
            return ParsedCalls(text[:marker])
