"""The front end's check of a request's adapter, before the request reaches the engine: a bad
adapter is the request's error (a ``ValueError`` naming the field), never the engine's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedserve.config import EngineConfig, LoRAConfig
from pagedserve.lora.adapter import ADAPTER_FILES, check_adapter
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


class AdapterFiles:
    """The engine core's check of each arriving request's adapter: its folder still holds
    the files a full check passed: a ``stat`` of each file while they are unchanged; a changed
    file is checked again (``check_adapter``), a missing one is the request's error."""

    def __init__(self, hf_config: Any, max_lora_rank: int) -> None:
        self.hf_config = hf_config
        self.max_lora_rank = max_lora_rank
        self.checked: dict[int, tuple[str, tuple[tuple[str, int, int], ...]]] = {}
        """lora_int_id -> (folder, its files' stamp) when it last passed."""

    def error(self, lora_request: LoRARequest) -> str | None:
        """Why the adapter cannot be read now, or None."""
        stamp = _files_stamp(Path(lora_request.lora_path))
        if self.checked.get(lora_request.lora_int_id) == (lora_request.lora_path, stamp):
            return None
        try:
            check_adapter(lora_request, self.hf_config, self.max_lora_rank)
        except ValueError as e:
            return str(e)
        self.checked[lora_request.lora_int_id] = (lora_request.lora_path, stamp)
        return None


def _files_stamp(folder: Path) -> tuple[tuple[str, int, int], ...]:
    """(name, mtime, size) of each adapter file in ``folder``; empty where none is (a folder
    gone: the full check then says what is wrong)."""
    stamps = []
    for name in ADAPTER_FILES:
        try:
            stat = (folder / name).stat()
        except OSError:
            continue
        stamps.append((name, stat.st_mtime_ns, stat.st_size))
    return tuple(stamps)


def lora_checker(config: EngineConfig) -> LoRAChecker | None:
    """The checker for an engine of ``config`` (None where it serves no adapters); reads the
    base model's config for the shapes adapters must have."""
    if not config.lora.enable_lora:
        return None
    from pagedserve.model.resolve import resolve_model_config

    return LoRAChecker(resolve_model_config(config.model).hf_config, config.lora)
