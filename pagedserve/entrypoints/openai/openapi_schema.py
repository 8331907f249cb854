"""``/openapi.json`` with what only the loaded model knows: the largest token id.

Token-id fields are typed ``TokenId`` (``protocol.py``), whose schema carries
``TOKEN_ID_DESCRIPTION``; once the engine is ready, each such schema also gets ``maximum``:
the model's vocabulary size - 1 (a larger id is answered 400). Before that the schema states
the bound in words only.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

TOKEN_ID_DESCRIPTION = "A token id: below the model's vocabulary size."


def install_token_id_bound(app: FastAPI, vocab_size: Callable[[], int | None]) -> None:
    """Serve ``app``'s schema with ``maximum`` on every token id; ``vocab_size()`` is None
    while the model is not loaded."""
    fastapi_schema = app.openapi

    def openapi() -> dict[str, Any]:
        schema = fastapi_schema()  # FastAPI's, built once and cached
        size = vocab_size()
        if size is None:
            return schema
        bounded = copy.deepcopy(schema)
        bound_token_ids(bounded, size - 1)
        return bounded

    app.openapi = openapi  # type: ignore[method-assign]


def bound_token_ids(node: Any, maximum: int) -> None:
    """Add ``maximum`` to every token-id schema under ``node``, in place."""
    if isinstance(node, dict):
        if node.get("description") == TOKEN_ID_DESCRIPTION:
            node["maximum"] = maximum
        for value in node.values():
            bound_token_ids(value, maximum)
    elif isinstance(node, list):
        for value in node:
            bound_token_ids(value, maximum)
