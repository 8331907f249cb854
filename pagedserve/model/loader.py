"""Build a model and fill its weights: Hugging Face safetensors, GGUF, or seeded dummy weights.

Checkpoints are streamed as ``(hf_name, tensor)`` pairs into ``model.load_weights``, which maps
Hugging Face names onto the fused parameters (one tensor in memory at a time beyond the model).
Every error names the file and the tensor it is about.

Under tensor parallelism each rank builds its shard of the model and streams the whole
checkpoint through it: every parameter's ``weight_loader`` keeps this rank's slice.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedserve.config import ModelConfig
from pagedserve.distributed.parallel_state import TensorParallelGroup, get_tp_group
from pagedserve.layers.linear import finish_loading
from pagedserve.model.checkpoint import WeightStream, iterate_weights
from pagedserve.model.dummy_weights import load_dummy_weights
from pagedserve.model.quantization import linear_method_for
from pagedserve.model.registry import get_model_class
from pagedserve.model.resolve import CheckpointError, ResolvedModel, resolve_model_config

__all__ = [
    "check_tensor_parallel_size",
    "get_max_model_len",
    "iterate_weights",
    "load_checkpoint",
    "load_model",
]


@runtime_checkable
class LoadsWeights(Protocol):
    """A model class of the registry: it maps checkpoint tensors onto its parameters."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...


def load_checkpoint(model: nn.Module, resolved: ResolvedModel) -> None:
    """Stream the checkpoint into ``model``. ``model.load_weights`` raises ValueError naming the
    tensor (a shape that does not fit, a name that matches no parameter, parameters left
    without a tensor); we add the file it came from."""
    if not isinstance(model, LoadsWeights):
        raise TypeError(f"{type(model).__name__} has no load_weights method")
    stream = WeightStream(resolved)
    try:
        model.load_weights(stream)
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"{stream.source()}: {e}") from e


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


def model_class_of(resolved: ResolvedModel) -> type[nn.Module]:
    try:
        return get_model_class(resolved.hf_config)
    except ValueError as e:
        raise CheckpointError(f"{resolved.config_source}: {e}") from e


def check_tensor_parallel_size(hf_config: PretrainedConfig, tp_size: int, source: object) -> None:
    """ValueError unless ``tp_size`` ranks can split the model evenly: query heads and the MLP
    width divide; KV heads divide, or divide ``tp_size`` (then each is replicated)."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    problems = [
        f"num_attention_heads {heads}" if heads % tp_size else "",
        f"intermediate_size {hf_config.intermediate_size}"
        if hf_config.intermediate_size % tp_size else "",
        f"num_key_value_heads {kv_heads}" if kv_heads % tp_size and tp_size % kv_heads else "",
    ]  # fmt: skip
    problems = [p for p in problems if p]
    if problems:
        raise ValueError(
            f"tensor_parallel_size: {tp_size} does not split {source} evenly "
            f"({', '.join(problems)})"
        )


def load_model(
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallelGroup | None = None,
) -> tuple[nn.Module, PretrainedConfig]:
    """Resolve ``model_config.model``, build its model class on ``device`` in ``dtype`` and load
    its weights (or seeded dummy weights). Returns the model in eval mode and its HF config.

    ``tp``: the tensor-parallel group whose shard to build; None: this process's group
    (``get_tp_group()``; a single rank unless a worker joined a group at start-up).
    """
    tp = get_tp_group() if tp is None else tp
    resolved = resolve_model_config(model_config)
    get_max_model_len(model_config, resolved.hf_config)  # refuse a bad length before building
    check_tensor_parallel_size(resolved.hf_config, tp.size, resolved.config_source)
    model_class = model_class_of(resolved)
    dummy = resolved.format == "dummy"
    linear_method = linear_method_for(model_config.quantization, resolved.quantization, dummy,
                                      device)
    model = model_class(resolved.hf_config, dtype, device, tp, linear_method)
    if dummy:
        # The single-rank model's shapes (on meta: no memory) give every rank the same values;
        # unquantized, so FP8 layers quantize its random weights as they load.
        whole = model_class(resolved.hf_config, dtype, torch.device("meta"))
        load_dummy_weights(model, whole, model_config.seed)
    else:
        load_checkpoint(model, resolved)
    finish_loading(model)
    return model.eval(), resolved.hf_config
