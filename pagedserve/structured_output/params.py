"""``StructuredOutputsParams``: the constraint a request's output must obey (vLLM's names).

Exactly one of ``json`` (a JSON schema, as a dict or JSON text), ``regex``, ``choice`` (a list
of strings), ``grammar`` (EBNF, xgrammar's dialect), ``json_object=True`` (any JSON object) or
``structural_tag`` (free text in which each trigger starts a structure that follows its JSON
schema: ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``, a dict or JSON
text) is set. The spec is parsed when the object is built, so a bad schema, regex or grammar
raises ``ValueError`` naming the field before the request reaches the engine.
"""

from __future__ import annotations

import json as json_module
from dataclasses import dataclass, field
from typing import Any

from pagedserve.structured_output.grammar import KINDS, parse_grammar, source_text

_MAX_CHOICES = 1024
_OBJECT_KINDS = {"json": "a JSON schema object", "structural_tag": "an object"}
"""Kinds given as a dict or its JSON text -> what the dict is."""


@dataclass
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    kind: str = field(init=False, default="")
    """Which field is set (one of ``KINDS``)."""
    source: str = field(init=False, default="")
    """The text compiled for it (canonical schema text, regex, EBNF); with ``kind`` the
    compiled-grammar cache key."""

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs: set exactly one of " + ", ".join(KINDS)
                + (f"; got {', '.join(given)}" if given else "; got none")
            )
        self.kind = given[0]
        self._check_type()
        try:
            self.source = source_text(self.kind, getattr(self, self.kind))
        except ValueError as exc:  # a structural tag of the wrong shape
            raise ValueError(f"structured_outputs.{self.kind}: {exc}") from None
        try:
            parse_grammar(self.kind, self.source)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.{self.kind}: {exc}") from None

    def _check_type(self) -> None:
        """The field's Python type; JSON text must parse (its schema is checked next)."""
        kind, value = self.kind, getattr(self, self.kind)
        name = f"structured_outputs.{kind}"
        if kind in _OBJECT_KINDS:
            if isinstance(value, str):
                try:
                    value = json_module.loads(value)
                except ValueError as exc:
                    raise ValueError(f"{name}: not valid JSON ({exc})") from None
            if not isinstance(value, dict):
                raise ValueError(f"{name}: expected {_OBJECT_KINDS[kind]} (or its JSON text), "
                                 f"got {value!r:.60}")
        elif kind == "choice":
            if (not isinstance(value, list | tuple) or not value
                    or not all(isinstance(c, str) and c for c in value)):
                raise ValueError(f"{name}: expected a non-empty list of non-empty strings")
            if len(value) > _MAX_CHOICES:
                raise ValueError(f"{name}: at most {_MAX_CHOICES} choices, got {len(value)}")
            self.choice = list(value)
        elif kind == "json_object":
            if value is not True:
                raise ValueError(f"{name}: expected true, got {value!r}")
        elif not isinstance(value, str) or not value:
            raise ValueError(f"{name}: expected a non-empty string, got {value!r:.60}")

    @property
    def key(self) -> tuple[str, str]:
        """The compiled-grammar cache key."""
        return self.kind, self.source
