"""A structured-output spec turned into an xgrammar ``Grammar``: what validation parses and
what the compiler compiles (the tokenizer is not needed to parse)."""

from __future__ import annotations

import json
import re
from typing import Any

_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
KINDS = ("json", "regex", "choice", "grammar", "json_object")
"""The kinds of constraint, in ``StructuredOutputsParams`` field order."""
ANY_WHITESPACE = False
"""JSON is generated with xgrammar's standard separators only (``", "`` and ``": "``): a
grammar that allows any run of whitespace lets a small or unsure model pad forever."""


def _message(exc: Exception) -> str:
    """xgrammar's error text without its log prefix (time, C++ file and line)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _XGRAMMAR_PREFIX.sub("", text)


def choice_ebnf(choices: list[str]) -> str:
    """``root ::= "a" | "b"``: one alternative per choice, each a JSON-escaped literal."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


JSON_OBJECT_SCHEMA = '{"type": "object"}'
"""``json_object``: any JSON object (OpenAI's JSON mode), not any JSON value."""


def _length_as_pattern(node: dict[str, Any]) -> dict[str, Any]:
    """A string schema with ``minLength`` / ``maxLength`` and no ``pattern``, its bounds moved
    into an equivalent pattern of plain characters. xgrammar's own conversion of the bounds
    lets raw control characters into the string, which no JSON parser accepts; the pattern
    leaves out quotes, backslashes and control characters, so the value's length is its
    text's."""
    low, high = node.get("minLength", 0), node.get("maxLength", "")
    out = {k: v for k, v in node.items() if k not in ("minLength", "maxLength")}
    plain_char = '[^"\\\\\\x00-\\x1f]'  # the regex [^"\\\x00-\x1f]
    out["pattern"] = f"^{plain_char}{{{low},{high}}}$"
    return out


def _compilable(schema: Any) -> Any:
    """``schema`` with every length-bounded string schema given as a pattern (recursively)."""
    if isinstance(schema, list):
        return [_compilable(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    node = {key: _compilable(value) for key, value in schema.items()}
    if (node.get("type") == "string" and "pattern" not in node and "format" not in node
            and ("minLength" in node or "maxLength" in node)):
        return _length_as_pattern(node)
    return node


def schema_text(schema: Any) -> str:
    """The text compiled for a JSON schema given as a dict or as JSON text (the cache key).
    Keys keep their order: properties are generated in the schema's order."""
    if isinstance(schema, str):
        schema = json.loads(schema)
    return json.dumps(_compilable(schema), ensure_ascii=False)


def source_text(kind: str, spec: Any) -> str:
    """What the compiler compiles for ``kind``: schema text (``json``, ``json_object``), regex
    or EBNF (choices become EBNF)."""
    if kind == "json":
        return schema_text(spec)
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind == "choice":
        return choice_ebnf(list(spec))
    return str(spec)


def parse_grammar(kind: str, source: str) -> Any:
    """The xgrammar ``Grammar`` of ``source`` (see ``source_text``); ValueError with
    xgrammar's reason when it does not parse."""
    import xgrammar as xgr  # imports torch: only when a constraint is used

    try:
        if kind in ("json", "json_object"):
            return xgr.Grammar.from_json_schema(source, any_whitespace=ANY_WHITESPACE)
        if kind == "regex":
            return xgr.Grammar.from_regex(source)
        if kind in ("choice", "grammar"):
            return xgr.Grammar.from_ebnf(source)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(_message(exc)) from None
    raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
