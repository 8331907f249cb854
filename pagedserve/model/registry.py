"""Model classes by the ``architectures`` name of a Hugging Face ``config.json``."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedserve.model.llama import LlamaForCausalLM, MistralForCausalLM
from pagedserve.model.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_CLASSES)


def get_model_class(hf_config: Any) -> type[nn.Module]:
    """The class for ``architectures[0]``; ValueError for unknown ones and unsupported features."""
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ValueError(
            "config.json: 'architectures' is missing or empty; supported: "
            + ", ".join(supported_architectures())
        )
    arch = architectures[0]
    if arch not in MODEL_CLASSES:
        raise ValueError(
            f"architectures: {arch!r} is not supported; supported: "
            + ", ".join(supported_architectures())
        )
    _check_full_attention(arch, hf_config)
    return MODEL_CLASSES[arch]


def _check_full_attention(arch: str, hf_config: Any) -> None:
    """Refuse sliding-window attention: every layer here attends over the whole context."""
    window = getattr(hf_config, "sliding_window", None)
    context = getattr(hf_config, "max_position_embeddings", None)
    layer_types = getattr(hf_config, "layer_types", None) or []
    windowed = window is not None and (context is None or window < context)
    if windowed or "sliding_attention" in layer_types:
        raise ValueError(
            f"{arch}: sliding_window={window} is smaller than the context "
            f"(max_position_embeddings={context}); sliding-window attention is not supported yet"
        )
