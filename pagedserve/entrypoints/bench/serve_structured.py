"""``bench serve --structured KIND``: the request fields that constrain every answer of the
workload, to compare constrained with unconstrained decoding on the same prompts."""

from __future__ import annotations

from typing import Any

STRUCTURED_KINDS = ("none", "json-schema", "json-object", "choice")

_STRING = {"type": "string"}
_TEN_FIELDS = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": _STRING,
        "email": _STRING,
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": _STRING},
        "address": {"type": "object",
                    "properties": {"city": _STRING, "zip": _STRING},
                    "required": ["city", "zip"]},
        "notes": _STRING,
    },
    "required": ["id", "name", "email", "age", "score", "active", "role", "tags", "address",
                 "notes"],
}
"""A schema of ten fields (nested object, array, enum, numbers): the workload of the
structured-output benchmark in docs/serving.md."""


def structured_fields(kind: str) -> dict[str, Any]:
    """The extra request fields for ``kind`` (one of ``STRUCTURED_KINDS``); {} for none."""
    if kind == "none":
        return {}
    if kind == "json-schema":
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": "record", "schema": _TEN_FIELDS, "strict": True}}}
    if kind == "json-object":
        return {"response_format": {"type": "json_object"}}
    if kind == "choice":
        return {"structured_outputs": {"choice": ["positive", "negative", "neutral"]}}
    raise ValueError(f"structured: {kind!r} is not one of {', '.join(STRUCTURED_KINDS)}")
