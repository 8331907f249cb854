"""Default sampling values from a model's ``generation_config.json`` (``--generation-config``).

Model authors put their recommended sampling there (Llama 3.1: temperature 0.6, top_p 0.9;
Qwen3: temperature 0.6, top_k 20, top_p 0.95). As vLLM's ``--generation-config auto`` does,
those values replace the engine's defaults for every field a request leaves unset; a field the
request sets wins. ``vllm`` ignores the file; any other value is a folder holding one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENERATION_CONFIG_FILE = "generation_config.json"
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
"""generation_config.json key -> SamplingParams field (the keys vLLM reads)."""


def default_sampling_values(generation_config: str, model_folder: Path) -> dict[str, Any]:
    """SamplingParams field -> value from the generation config that ``generation_config``
    (auto | vllm | a folder) names; empty when there is none or it sets none of the fields."""
    if generation_config == "vllm":
        return {}
    folder = model_folder if generation_config == "auto" else Path(generation_config)
    path = folder / GENERATION_CONFIG_FILE
    if not path.is_file():
        if generation_config != "auto":
            raise ValueError(f"generation_config: {path} does not exist")
        return {}
    try:
        values = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"generation_config: cannot read {path}: {e}") from e
    if not isinstance(values, dict):
        raise ValueError(f"generation_config: {path} does not hold a JSON object")
    return {field: values[key] for key, field in SAMPLING_FIELDS.items()
            if values.get(key) is not None}
