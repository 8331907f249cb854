"""Scanning JSON text that may still be growing (a model's output, token by token): where a
value ends, and the members of an object seen so far.

A tool call's arguments are kept as the exact text the model wrote, so the fragments a stream
sends add up to the arguments of the whole output. Not a validator: only strings and brackets
are tracked; the caller parses a finished value with ``json.loads``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WHITESPACE = " \t\n\r"
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
"""Possessive: runs of plain characters are matched in C, and an unfinished string fails
without backtracking."""
_SCALAR_END = re.compile(r"[,}\]\s]")
_STRUCTURE = re.compile(r'["{}\[\]]')
"""What a container's end is looked for by (the regexes run in C: a long string argument
costs one match, not a Python step per character)."""


class MalformedJSON(ValueError):
    """The text cannot be (the start of) the JSON expected there."""


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def _string_end(text: str, start: int) -> int | None:
    """Past the closing quote of the string at ``text[start]``."""
    match = _STRING.match(text, start)
    return None if match is None else match.end()


def _container_end(text: str, start: int) -> int | None:
    depth, i = 0, start
    while (match := _STRUCTURE.search(text, i)) is not None:
        i = match.start()
        if match.group() == '"':
            end = _string_end(text, i)
            if end is None:
                return None
            i = end
            continue
        depth += 1 if match.group() in "{[" else -1
        if depth == 0:
            return i + 1
        i += 1
    return None


def value_end(text: str, start: int) -> int | None:
    """The index just past the JSON value that starts at ``text[start]``; None while it is
    incomplete (a number or literal is complete once a delimiter follows it)."""
    char = text[start]
    if char == '"':
        return _string_end(text, start)
    if char in "{[":
        return _container_end(text, start)
    match = _SCALAR_END.search(text, start)
    return None if match is None else match.start()


@dataclass
class Member:
    """One ``"key": value`` of an object: the value is ``text[start:end]``, ``end`` None while
    the value is incomplete."""

    key: str
    start: int
    end: int | None


def object_members(text: str, start: int) -> tuple[list[Member], int | None]:
    """The members of the object whose ``{`` is at ``text[start]``, as far as the text goes,
    and the index past its ``}`` (None while open). ``MalformedJSON`` when it is not an
    object's text."""
    members: list[Member] = []
    i = skip_whitespace(text, start + 1)
    if text.startswith("}", i):
        return members, i + 1
    while i < len(text):
        if text[i] != '"':
            raise MalformedJSON(f"expected a key at {i}")
        key_end = _string_end(text, i)
        colon = len(text) if key_end is None else skip_whitespace(text, key_end)
        if colon >= len(text):
            return members, None
        if text[colon] != ":":
            raise MalformedJSON(f"expected ':' at {colon}")
        value = skip_whitespace(text, colon + 1)
        if value >= len(text):
            return members, None
        assert key_end is not None
        end = value_end(text, value)
        members.append(Member(json.loads(text[i:key_end]), value, end))
        after = len(text) if end is None else skip_whitespace(text, end)
        if after >= len(text):
            return members, None
        if text[after] == "}":
            return members, after + 1
        if text[after] != ",":
            raise MalformedJSON(f"expected ',' or '}}' at {after}")
        i = skip_whitespace(text, after + 1)
    return members, None
