"""A structured-output spec turned into an xgrammar ``Grammar``: what validation parses and
what the compiler compiles (the tokenizer is not needed to parse)."""

from __future__ import annotations

import json
import re
from typing import Any

_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
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


def structural_tag_text(spec: Any) -> str:
    """A structural tag (vLLM's and xgrammar's: ``{"structures": [{"begin", "schema", "end"},
    ...], "triggers": [...]}``) as canonical JSON text; ValueError for another shape. Free
    text is generated until a trigger; a structure that begins with it follows its schema up
    to its end."""
    if isinstance(spec, str):
        spec = json.loads(spec)
    if not isinstance(spec, dict) or set(spec) != {"structures", "triggers"}:
        raise ValueError("expected an object with exactly structures and triggers")
    structures, triggers = spec["structures"], spec["triggers"]
    if not isinstance(triggers, list) or not triggers or not all(
            isinstance(t, str) and t for t in triggers):
        raise ValueError("triggers: expected a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structures: expected a non-empty list")
    for i, item in enumerate(structures):
        if not (isinstance(item, dict) and set(item) == {"begin", "schema", "end"}
                and isinstance(item["begin"], str) and isinstance(item["end"], str)
                and isinstance(item["schema"], dict)):
            raise ValueError(f"structures[{i}]: expected {{begin, schema, end}} with string "
                             "begin and end and a JSON schema object")
    canonical = [{"begin": it["begin"], "schema": _compilable(it["schema"]), "end": it["end"]}
                 for it in structures]
    return json.dumps({"structures": canonical, "triggers": triggers}, ensure_ascii=False)


def structural_tag_spec(source: str) -> str:
    """xgrammar's structural-tag JSON of a ``structural_tag_text``: triggered tags whose JSON
    content allows at most one whitespace character in a row (as ``ANY_WHITESPACE`` keeps the
    plain JSON kinds from letting a model pad forever)."""
    spec = json.loads(source)
    tags = [{"type": "tag", "begin": it["begin"], "end": it["end"],
             "content": {"type": "json_schema", "json_schema": it["schema"],
                         "max_whitespace_cnt": 1}}
            for it in spec["structures"]]
    return json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": spec["triggers"], "tags": tags}})


def source_text(kind: str, spec: Any) -> str:
    """What the compiler compiles for ``kind``: schema text (``json``, ``json_object``), regex,
    EBNF (choices become EBNF) or a structural tag's JSON."""
    if kind == "structural_tag":
        return structural_tag_text(spec)
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
        if kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(structural_tag_spec(source))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(_message(exc)) from None
    raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
