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


def schema_text(schema: Any) -> str:
    """The text of a JSON schema given as a dict or as JSON text (the cache key). Keys keep
    their order: properties are generated in the schema's order."""
    if isinstance(schema, str):
        schema = json.loads(schema)
    return json.dumps(schema, ensure_ascii=False)


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
