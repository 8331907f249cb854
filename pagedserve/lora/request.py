"""LoRARequest: which adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, id and folder.

    ``lora_int_id`` identifies the adapter inside the engine: requests with equal ids share
    its device slot and their prefix-cache entries, so one id must always mean one folder.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None
    """The model the adapter was trained on (shown by the server's /v1/models)."""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name: expected a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: expected an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path: expected a non-empty string, got {self.lora_path!r}")
