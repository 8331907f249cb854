"""Structured-output fields of the OpenAI-compatible API and their mapping to
``StructuredOutputsParams`` (docs/serving.md#structured-outputs).

OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs``
object and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``
aliases: at most one of them per request. A bad spec is a 400 naming the field the client sent.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from pagedserve.entrypoints.openai.unsupported_fields import RequestBody
from pagedserve.structured_output.params import StructuredOutputsParams

_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
            "guided_grammar": "grammar"}


def _renamed(message: str, field: str, kind: str) -> str:
    """The engine's message with the field the client sent in front (``guided_regex: ...``
    for ``structured_outputs.regex: ...``); ``structured_outputs`` keeps its own names."""
    if field == "structured_outputs":
        return message
    for engine_name in (f"structured_outputs.{kind}", "structured_outputs"):
        if message.startswith(engine_name):
            return field + message[len(engine_name):]
    return message


class JsonSchemaFormat(RequestBody):
    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(..., alias="schema")
    strict: bool | None = Field(
        None, description="Accepted; the schema is always enforced (xgrammar's strict mode).")


class TagStructure(RequestBody):
    model_config = ConfigDict(populate_by_name=True)

    begin: str
    json_schema: dict[str, Any] = Field(..., alias="schema")
    end: str


class ResponseFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[TagStructure] | None = Field(
        None, description="structural_tag: after a trigger, the structure that begins with it "
        "follows its schema up to its end.")
    triggers: list[str] | None = None


class StructuredOutputsObject(RequestBody):
    """vLLM's ``structured_outputs`` extra field."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None


class StructuredOutputFields(RequestBody):
    """The request fields; mixed into the completions and chat request bodies."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsObject | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one constraint the request sets, or None; ValueError naming the field."""
        given = self._given()
        if len(given) > 1:
            names = ", ".join(g[0] for g in given)
            raise ValueError(f"{given[1][0]}: set at most one of response_format, "
                             f"structured_outputs and guided_*; got {names}")
        if not given:
            return None
        field, kwargs = given[0]
        try:
            return StructuredOutputsParams(**kwargs)
        except ValueError as exc:
            raise ValueError(_renamed(str(exc), field, next(iter(kwargs), ""))) from None

    def _given(self) -> list[tuple[str, dict[str, Any]]]:
        """(the field as the client named it, StructuredOutputsParams kwargs) per field set."""
        given: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise ValueError("response_format.json_schema: required when type is "
                                 "'json_schema'")
            given.append(("response_format.json_schema.schema",
                          {"json": fmt.json_schema.json_schema}))
        elif fmt is not None and fmt.type == "structural_tag":
            if fmt.structures is None or fmt.triggers is None:
                raise ValueError("response_format: a structural_tag needs structures and "
                                 "triggers")
            tag = {"structures": [t.model_dump(by_alias=True) for t in fmt.structures],
                   "triggers": fmt.triggers}
            given.append(("response_format", {"structural_tag": tag}))
        if self.structured_outputs is not None:
            kwargs = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            given.append(("structured_outputs", kwargs))
        for alias, kind in _ALIASES.items():
            if getattr(self, alias) is not None:
                given.append((alias, {kind: getattr(self, alias)}))
        return given
