"""Hugging Face checkpoint names onto a model's (partly fused) parameters.

Checkpoints store ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj`` and ``up_proj`` separately;
the model holds them fused as ``qkv_proj`` and ``gate_up_proj``. Each parameter's
``weight_loader`` copies one checkpoint tensor into its place (its shard).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pagedserve.layers.linear import ShardId, weight_loader_of

# (fused parameter, checkpoint name, shard id)
STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)

ShardKey = tuple[str, ShardId]


def map_checkpoint_name(name: str) -> ShardKey:
    """``model.layers.0.self_attn.k_proj.weight`` -> (``model.layers.0.self_attn.qkv_proj.weight``, "k")."""
    for fused, original, shard_id in STACKED_PARAMS:
        if f".{original}." in name:
            return name.replace(f".{original}.", f".{fused}."), shard_id
    return name, None


def expected_shards(param_names: Iterable[str]) -> set[ShardKey]:
    """Every (parameter, shard) a complete checkpoint must fill."""
    expected: set[ShardKey] = set()
    for name in param_names:
        shards: list[ShardId] = [
            shard for fused, _, shard in STACKED_PARAMS if f".{fused}." in name
        ]
        expected.update((name, shard) for shard in shards or [None])
    return expected


def load_checkpoint_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    ignore: Callable[[str], bool],
) -> set[str]:
    """Load every checkpoint tensor not ignored; returns the names of the loaded parameters.

    Raises ValueError naming the tensor when a name matches no parameter or a shape does not
    fit, and naming the parameters left without a tensor at the end.
    """
    params = dict(model.named_parameters())
    loaded: set[ShardKey] = set()
    with torch.no_grad():
        for name, tensor in weights:
            if ignore(name):
                continue
            param_name, shard_id = map_checkpoint_name(name)
            if param_name not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}"
                )
            param = params[param_name]
            try:
                weight_loader_of(param)(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r} -> {param_name}: {e}") from None
            loaded.add((param_name, shard_id))
    missing = expected_shards(params) - loaded
    if missing:
        described = sorted(f"{p}" if s is None else f"{p}[{s}]" for p, s in missing)
        raise ValueError(f"checkpoint has no tensor for: {', '.join(described)}")
    return {param_name for param_name, _ in loaded}
