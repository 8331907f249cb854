"""Build a model and fill its weights: Hugging Face safetensors, GGUF, or seeded dummy weights.

Checkpoints are streamed as ``(hf_name, tensor)`` pairs into ``model.load_weights``, which maps
Hugging Face names onto the fused parameters (one tensor in memory at a time beyond the model).
Every error names the file and the tensor it is about.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedserve.config import ModelConfig
from pagedserve.model.checkpoint import WeightStream, iterate_weights
from pagedserve.model.registry import get_model_class
from pagedserve.model.resolve import CheckpointError, ResolvedModel, resolve_model

__all__ = [
    "get_max_model_len",
    "initialize_dummy_weights",
    "iterate_weights",
    "load_checkpoint",
    "load_model",
]

DUMMY_STD = 0.02
"""Standard deviation of dummy weights: the ``initializer_range`` of Llama-family configs."""


def load_checkpoint(model: nn.Module, resolved: ResolvedModel) -> None:
    """Stream the checkpoint into ``model``. ``model.load_weights`` raises ValueError naming the
    tensor (a shape that does not fit, a name that matches no parameter, parameters left
    without a tensor); we add the file it came from."""
    stream = WeightStream(resolved)
    try:
        model.load_weights(stream)
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"{stream.source()}: {e}") from e


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int, std: float = DUMMY_STD) -> None:
    """Seeded random weights, generated in place on the parameters' device (fast for 8B on a
    GPU). Norm weights are ones so activations keep their scale; all else ~ N(0, std)."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if param.dim() == 1 and "norm" in name.rsplit(".", 2)[-2]:
            param.fill_(1.0)
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(param.device).manual_seed(seed)
        param.normal_(0.0, std, generator=generators[param.device])


def get_max_model_len(model_config: ModelConfig, hf_config: PretrainedConfig) -> int:
    """The context length: ``max_model_len`` if given (at most the model's
    ``max_position_embeddings``), else ``max_position_embeddings``."""
    limit = int(hf_config.max_position_embeddings)
    if model_config.max_model_len is None:
        return limit
    if model_config.max_model_len > limit:
        raise ValueError(
            f"max_model_len: {model_config.max_model_len} is larger than the model's "
            f"max_position_embeddings ({limit})"
        )
    return model_config.max_model_len


def _model_class(resolved: ResolvedModel) -> type[nn.Module]:
    try:
        return get_model_class(resolved.hf_config)
    except ValueError as e:
        raise CheckpointError(f"{resolved.config_source}: {e}") from e


def load_model(
    model_config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> tuple[nn.Module, PretrainedConfig]:
    """Resolve ``model_config.model``, build its model class on ``device`` in ``dtype`` and load
    its weights (or seeded dummy weights). Returns the model in eval mode and its HF config."""
    resolved = resolve_model(model_config.model, model_config.load_format)
    get_max_model_len(model_config, resolved.hf_config)  # refuse a bad length before building
    model = _model_class(resolved)(resolved.hf_config, dtype, device)
    if resolved.format == "dummy":
        initialize_dummy_weights(model, model_config.seed)
    else:
        load_checkpoint(model, resolved)
    return model.eval(), resolved.hf_config
