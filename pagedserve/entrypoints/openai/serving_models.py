"""The models a server answers to (vLLM's ``OpenAIServingModels``): the base model under its
served name, and the LoRA adapters served beside it, from ``--lora-modules`` at start-up and
from ``POST /v1/load_lora_adapter`` at run time.

A request's ``model`` is read in one place, ``OpenAIServingModels.resolve``: a base model name
runs the request without an adapter, an adapter's name with its ``LoRARequest``, any other name
is a 404.

Adapter ids are handed out 1, 2, ... and never reused: the engine keys its device slots, its
host cache and its prefix-cache entries by ``lora_int_id``, so an id given again to another
folder could serve the unloaded adapter's weights (or its KV blocks) under the new name.

This module imports no torch: ``--lora-modules`` is parsed before the engine is loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING

from pydantic import Field

from pagedserve.entrypoints.openai.errors import OpenAIError, bad_request
from pagedserve.entrypoints.openai.responses import ModelCard
from pagedserve.entrypoints.openai.unsupported_fields import RequestBody
from pagedserve.lora.request import LoRARequest

if TYPE_CHECKING:
    from pagedserve.lora.check import LoRAChecker

logger = logging.getLogger(__name__)


# -- start-up: --lora-modules ----------------------------------------------------------------


@dataclass(frozen=True)
class LoRAModulePath:
    """One item of ``--lora-modules``."""

    name: str
    """The adapter's served name: what requests send as ``model``."""
    path: str
    """The PEFT adapter folder."""
    base_model_name: str | None = None
    """The model it was trained on (``parent`` in ``/v1/models``); None: the served one."""


_MODULE_KEYS = frozenset({"name", "path", "base_model_name"})


def parse_lora_module(text: str) -> LoRAModulePath:
    """argparse ``type`` of ``--lora-modules``: ``NAME=PATH``, or vLLM's JSON form
    ``{"name": ..., "path": ..., "base_model_name": ...}`` (base_model_name optional)."""
    if text.lstrip().startswith("{"):
        return _module_from_json(text)
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(
            f"expected NAME=PATH or a JSON object with name and path, got {text!r}")
    return LoRAModulePath(name.strip(), path.strip())


def _module_from_json(text: str) -> LoRAModulePath:
    try:
        item = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"invalid JSON {text!r} ({e})") from e
    if not isinstance(item, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    unknown = sorted(set(item) - _MODULE_KEYS)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown key {unknown[0]!r} in {text!r} (keys: name, path, base_model_name)")
    for key in ("name", "path"):
        if not isinstance(item.get(key), str) or not item[key].strip():
            raise argparse.ArgumentTypeError(f"{key}: expected a non-empty string in {text!r}")
    base = item.get("base_model_name")
    if base is not None and not isinstance(base, str):
        raise argparse.ArgumentTypeError(f"base_model_name: expected a string in {text!r}")
    return LoRAModulePath(item["name"].strip(), item["path"].strip(), base or None)


def check_lora_modules(
    modules: Sequence[LoRAModulePath], enable_lora: bool, served_model_names: Sequence[str]
) -> None:
    """What can be refused before the model loads; ``ValueError`` naming the option."""
    if modules and not enable_lora:
        raise ValueError("--lora-modules: serving LoRA adapters needs --enable-lora")
    seen: set[str] = set()
    for module in modules:
        if module.name in served_model_names:
            raise ValueError(f"--lora-modules {module.name}: the name is the base model's "
                             "served name; give the adapter another one")
        if module.name in seen:
            raise ValueError(f"--lora-modules {module.name}: the name is given twice")
        seen.add(module.name)


def served_lora_requests(
    modules: Sequence[LoRAModulePath], checker: LoRAChecker | None
) -> list[LoRARequest]:
    """``--lora-modules`` as ``LoRARequest`` objects with ids 1, 2, ... in order, each adapter
    checked against the base model, so a bad one stops the server at start-up instead of
    failing its first request. ``ValueError`` naming the module."""
    if not modules:
        return []
    if checker is None:
        raise ValueError("--lora-modules: serving LoRA adapters needs --enable-lora")
    requests = []
    for lora_int_id, module in enumerate(modules, start=1):
        lora = LoRARequest(module.name, lora_int_id, module.path, module.base_model_name)
        try:
            checker.check(lora)
        except ValueError as e:
            raise ValueError(f"--lora-modules {module.name}: {e}") from e
        requests.append(lora)
    return requests


# -- run time: the registry ------------------------------------------------------------------


class LoadLoRAAdapterRequest(RequestBody):
    """``POST /v1/load_lora_adapter`` (vLLM's)."""

    lora_name: str = Field(min_length=1, description="The served name requests send as model.")
    lora_path: str = Field(min_length=1, description="The PEFT adapter folder, on the server.")


class UnloadLoRAAdapterRequest(RequestBody):
    """``POST /v1/unload_lora_adapter`` (vLLM's)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = Field(
        None, description="Optional; when given it must be the named adapter's id.")


class OpenAIServingModels:
    """The served names: the base model's, and the adapters' (name -> ``LoRARequest``)."""

    def __init__(
        self,
        served_model_names: list[str],
        model_root: str,
        lora_requests: Sequence[LoRARequest] = (),
        lora_checker: LoRAChecker | None = None,
    ) -> None:
        """``lora_checker``: checks adapters loaded at run time and forgets unloaded ones;
        the engine's own (None: the server runs without --enable-lora)."""
        self.served_model_names = served_model_names
        self.model_root = model_root
        self.lora_requests: dict[str, LoRARequest] = {r.lora_name: r for r in lora_requests}
        self.lora_checker = lora_checker
        self._next_lora_id = max((r.lora_int_id for r in lora_requests), default=0) + 1
        self._lock = asyncio.Lock()
        """Loads and unloads one at a time: a name is checked free and then taken."""

    # -- requests --------------------------------------------------------------------------

    def resolve(self, model: str | None) -> tuple[str, LoRARequest | None]:
        """The name to report in responses, and the adapter the request runs with (None: the
        base model); a missing ``model`` is the base model. 404 for a model not served."""
        if not model:
            return self.served_model_names[0], None
        if model in self.served_model_names:
            return model, None
        lora = self.lora_requests.get(model)
        if lora is None:
            served = ", ".join([*self.served_model_names, *self.lora_requests])
            raise OpenAIError(
                HTTPStatus.NOT_FOUND,
                f"The model `{model}` does not exist (this server serves {served}).",
                param="model",
                code="model_not_found",
            )
        return model, lora

    def model_cards(self, max_model_len: int | None) -> list[ModelCard]:
        """``/v1/models``: the base model's names, then each adapter (``root``: its folder,
        ``parent``: the model it was trained on, else the base model's served name)."""
        base = [ModelCard(id=name, root=self.model_root, max_model_len=max_model_len)
                for name in self.served_model_names]
        adapters = [
            ModelCard(id=lora.lora_name, root=lora.lora_path, max_model_len=max_model_len,
                      parent=lora.base_model_name or self.served_model_names[0])
            for lora in self.lora_requests.values()
        ]
        return base + adapters

    # -- runtime updates -------------------------------------------------------------------

    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> str:
        """Check the adapter against the base model (in a thread: a ``.bin`` adapter is read
        whole) and serve it under the next id; 400 naming the field otherwise. The id is
        spent even when the check fails: a check cut short may have recorded it."""
        checker = self.lora_checker
        if checker is None:
            raise bad_request("lora_name: this server serves no LoRA adapters (start it with "
                              "--enable-lora)", param="lora_name")
        name = request.lora_name
        async with self._lock:
            self._check_new_name(name)
            lora = LoRARequest(name, self._next_lora_id, request.lora_path)
            self._next_lora_id += 1
            try:
                await asyncio.to_thread(checker.check, lora)
            except ValueError as e:
                raise bad_request(str(e), param="lora_path") from e
            self.lora_requests[name] = lora
        logger.info("LoRA adapter %s (id %d) loaded from %s", name, lora.lora_int_id,
                    lora.lora_path)
        return f"Success: LoRA adapter '{name}' added successfully."

    def _check_new_name(self, name: str) -> None:
        if name in self.lora_requests:
            raise bad_request(f"lora_name: the LoRA adapter '{name}' has already been loaded",
                              param="lora_name")
        if name in self.served_model_names:
            raise bad_request(f"lora_name: '{name}' is the base model's served name",
                              param="lora_name")

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> str:
        """Stop serving the adapter; requests already running with it finish normally. The
        engine drops its copy when its least-recently-used cache does."""
        name = request.lora_name
        async with self._lock:
            lora = self.lora_requests.get(name)
            if lora is None:
                raise OpenAIError(HTTPStatus.NOT_FOUND,
                                  f"lora_name: the LoRA adapter '{name}' cannot be found",
                                  param="lora_name", code="model_not_found")
            if request.lora_int_id is not None and request.lora_int_id != lora.lora_int_id:
                raise bad_request(f"lora_int_id: the LoRA adapter '{name}' has id "
                                  f"{lora.lora_int_id}, not {request.lora_int_id}",
                                  param="lora_int_id")
            del self.lora_requests[name]
            if self.lora_checker is not None:
                self.lora_checker.forget(lora.lora_int_id)
        logger.info("LoRA adapter %s (id %d) unloaded", name, lora.lora_int_id)
        return f"Success: LoRA adapter '{name}' removed successfully."
