"""Seeded random weights that do not depend on the tensor-parallel size.

Every rank generates the weights of the whole (single-rank) model, parameter by parameter in
one seeded stream, and keeps its shard through the same ``weight_loader``s a checkpoint goes
through. So TP=1 and TP=2 run the same dummy model, and their greedy tokens can be compared.

The whole model's shapes come from a single-rank copy built on the ``meta`` device (no memory).
Fused parameters are cut back into their checkpoint pieces (q / k / v, gate / up) before they
reach the loaders, as a checkpoint would deliver them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from pagedserve.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ShardId,
    weight_loader_of,
)
from pagedserve.layers.vocab_embedding import VocabParallelEmbedding

DUMMY_STD = 0.02
"""Standard deviation of dummy weights: the ``initializer_range`` of Llama-family configs."""


def _is_norm_weight(name: str, param: torch.Tensor) -> bool:
    return param.dim() == 1 and "norm" in name.rsplit(".", 2)[-2]


def _checkpoint_pieces(
    module: nn.Module, full: torch.Tensor
) -> Iterator[tuple[ShardId, torch.Tensor]]:
    """``full`` (a parameter of the single-rank ``module``) as a checkpoint holds it: fused
    rows cut into their pieces, vocabulary padding rows dropped."""
    if isinstance(module, QKVParallelLinear):
        sizes = [module.q_size, module.kv_size, module.kv_size]
        yield from zip("qkv", full.split(sizes, dim=0), strict=True)
    elif isinstance(module, MergedColumnParallelLinear):
        yield from enumerate(full.split(module.sizes_per_rank, dim=0))
    elif isinstance(module, VocabParallelEmbedding):
        yield None, full[: module.num_embeddings]
    else:
        yield None, full


@torch.no_grad()
def load_dummy_weights(
    model: nn.Module, whole: nn.Module, seed: int, std: float = DUMMY_STD
) -> None:
    """Fill ``model`` (one rank's shard) with its slices of seeded random weights for ``whole``
    (the single-rank model of the same config, usually on ``meta``). Norm weights are ones so
    activations keep their scale; all else ~ N(0, std), generated on the parameters' device."""
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    generator = torch.Generator(device).manual_seed(seed)
    modules = dict(whole.named_modules())
    for name, meta in whole.named_parameters():
        if name not in params:
            raise ValueError(f"dummy weights: {name} of the whole model is not in the shard")
        full = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        if _is_norm_weight(name, meta):
            full.fill_(1.0)
        else:
            full.normal_(0.0, std, generator=generator)
        param = params[name]
        module = modules[name.rsplit(".", 1)[0]]
        for shard_id, piece in _checkpoint_pieces(module, full):
            weight_loader_of(param)(param, piece, shard_id)
