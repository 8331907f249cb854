"""The front end's check of a request's adapter, before the request reaches the engine: a bad
adapter is the request's error (a ``ValueError`` naming the field), never the engine's."""

from __future__ import annotations

from typing import Any

from pagedserve.config import EngineConfig, LoRAConfig
from pagedserve.lora.adapter import check_adapter
from pagedserve.lora.request import LoRARequest


class LoRAChecker:
    """Checks each adapter folder once (its config and tensor shapes against the base model),
    and that one ``lora_int_id`` always names one folder."""

    def __init__(self, hf_config: Any, config: LoRAConfig) -> None:
        self.hf_config = hf_config
        self.config = config
        self.path_of_id: dict[int, str] = {}
        """lora_int_id -> the folder it was first checked with."""

    def check(self, lora_request: object) -> None:
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request: expected a LoRARequest, got "
                             f"{type(lora_request).__name__}")
        lora_id, path = lora_request.lora_int_id, lora_request.lora_path
        known = self.path_of_id.get(lora_id)
        if known == path:
            return
        if known is not None:
            raise ValueError(f"lora_request: lora_int_id {lora_id} already names the adapter "
                             f"at {known}, not {path}")
        check_adapter(lora_request, self.hf_config, self.config.max_lora_rank)
        self.path_of_id[lora_id] = path

    def forget(self, lora_int_id: int) -> None:
        """An unloaded adapter's id may name another folder later."""
        self.path_of_id.pop(lora_int_id, None)


def lora_checker(config: EngineConfig) -> LoRAChecker | None:
    """The checker for an engine of ``config`` (None where it serves no adapters); reads the
    base model's config for the shapes adapters must have."""
    if not config.lora.enable_lora:
        return None
    from pagedserve.model.resolve import resolve_model_config

    return LoRAChecker(resolve_model_config(config.model).hf_config, config.lora)
