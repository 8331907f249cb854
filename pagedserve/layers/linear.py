"""Linear layers split for tensor parallelism: column, row, fused QKV and merged gate/up.

A column-parallel layer owns a slice of the output features of the full layer
(weight ``[output_size / tp_size, input_size]``) and needs no communication. A row-parallel
layer owns a slice of the input features (weight ``[output_size, input_size / tp_size]``) and
produces a partial sum that ``all_reduce`` adds up across ranks.

Every parameter carries ``weight_loader(param, loaded_weight, shard_id=None)``: it takes the
full tensor from a checkpoint and copies this rank's slice into ``param``. Fused layers take a
``shard_id`` naming which checkpoint tensor arrives (``"q"``/``"k"``/``"v"``, or the index of a
merged output). A tensor of the wrong shape raises ``ValueError``; the caller adds its name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

AllReduce = Callable[[torch.Tensor], torch.Tensor]
ShardId = str | int | None
WeightLoader = Callable[[nn.Parameter, torch.Tensor, ShardId], None]
# The attribute of a parameter that holds its loader (nn.Parameter declares no such field).
_WEIGHT_LOADER_ATTR = "weight_loader"


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what}: {numerator} is not divisible by tp_size {denominator}")
    return numerator // denominator


def copy_shard(
    dst: torch.Tensor, loaded: torch.Tensor, dim: int, num_shards: int, index: int
) -> None:
    """Copy slice ``index`` of ``loaded`` (cut into ``num_shards`` equal parts along ``dim``)."""
    full = list(dst.shape)
    full[dim] *= num_shards
    if list(loaded.shape) != full:
        raise ValueError(f"expected a tensor of shape {tuple(full)}, got {tuple(loaded.shape)}")
    size = dst.shape[dim]
    dst.copy_(loaded.narrow(dim, index * size, size))


def new_parameter(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    weight_loader: Callable[..., None],
) -> nn.Parameter:
    """An uninitialized inference parameter; the loader fills it."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    setattr(param, _WEIGHT_LOADER_ATTR, weight_loader)
    return param


def weight_loader_of(param: nn.Parameter) -> WeightLoader:
    """The ``weight_loader`` that ``new_parameter`` attached to ``param``."""
    loader: WeightLoader = getattr(param, _WEIGHT_LOADER_ATTR)
    return loader


def _check_unfused(shard_id: ShardId, layer: str) -> None:
    if shard_id is not None:
        raise ValueError(f"{layer} holds one tensor, got shard_id {shard_id!r}")


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows: rank r holds rows ``[r * n, (r + 1) * n)``."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.output_size_per_rank = divide(output_size, tp_size, type(self).__name__)
        shape = (self.output_size_per_rank, input_size)
        self.weight = new_parameter(shape, dtype, device, self.weight_loader)
        if bias:
            self.bias = new_parameter(shape[:1], dtype, device, self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        _check_unfused(shard_id, type(self).__name__)
        copy_shard(param.data, loaded_weight, 0, self.tp_size, self.tp_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers with one input stacked into one GEMM (gate and up).

    The rank's weight is ``[sum(output_sizes) / tp_size, input_size]``: each rank keeps its
    slice of every merged output, in order, so the local output splits the same way.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        name = type(self).__name__
        self.sizes_per_rank = [divide(size, tp_size, name) for size in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, dtype, device, tp_rank, tp_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.sizes_per_rank):
            raise ValueError(
                f"{type(self).__name__} needs shard_id 0..{len(self.sizes_per_rank) - 1}, "
                f"got {shard_id!r}"
            )
        offset = sum(self.sizes_per_rank[:shard_id])
        dst = param.data.narrow(0, offset, self.sizes_per_rank[shard_id])
        copy_shard(dst, loaded_weight, 0, self.tp_size, self.tp_rank)


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections as one GEMM; output per rank is ``[q | k | v]``.

    Query heads are split across ranks. KV heads are split too while there are at least
    ``tp_size`` of them; with fewer, each KV head is replicated on ``tp_size / num_kv_heads``
    ranks (rank r holds KV head ``r // replicas``).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        name = type(self).__name__
        self.head_dim = head_dim
        self.num_heads_per_rank = divide(num_heads, tp_size, f"{name} num_heads")
        if num_kv_heads >= tp_size:
            self.num_kv_heads_per_rank = divide(num_kv_heads, tp_size, f"{name} num_kv_heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads_per_rank = 1
            self.kv_replicas = divide(tp_size, num_kv_heads, f"{name} tp_size / num_kv_heads")
        self.q_size = self.num_heads_per_rank * head_dim
        self.kv_size = self.num_kv_heads_per_rank * head_dim
        output_size = (self.q_size + 2 * self.kv_size) * tp_size
        super().__init__(hidden_size, output_size, bias, dtype, device, tp_rank, tp_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        kv_shards = self.tp_size // self.kv_replicas
        kv_index = self.tp_rank // self.kv_replicas
        layout = {
            "q": (0, self.q_size, self.tp_size, self.tp_rank),
            "k": (self.q_size, self.kv_size, kv_shards, kv_index),
            "v": (self.q_size + self.kv_size, self.kv_size, kv_shards, kv_index),
        }
        if shard_id not in layout:
            raise ValueError(f"{type(self).__name__} needs shard_id q, k or v, got {shard_id!r}")
        offset, size, num_shards, index = layout[shard_id]
        copy_shard(param.data.narrow(0, offset, size), loaded_weight, 0, num_shards, index)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns; ``all_reduce`` sums the ranks' parts.

    The input is already split (the output of a column-parallel layer). The bias is added
    on rank 0 only, so the sum holds it once.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        tp_rank: int = 0,
        tp_size: int = 1,
        all_reduce: AllReduce | None = None,
    ) -> None:
        super().__init__()
        if tp_size > 1 and all_reduce is None:
            raise ValueError(f"{type(self).__name__}: tp_size {tp_size} needs an all_reduce")
        self.input_size = input_size
        self.output_size = output_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.all_reduce = all_reduce
        self.input_size_per_rank = divide(input_size, tp_size, type(self).__name__)
        shape = (output_size, self.input_size_per_rank)
        self.weight = new_parameter(shape, dtype, device, self.weight_loader)
        if bias:
            self.bias = new_parameter((output_size,), dtype, device, self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        _check_unfused(shard_id, type(self).__name__)
        if param.dim() == 1:  # the bias is not split
            copy_shard(param.data, loaded_weight, 0, 1, 0)
        else:
            copy_shard(param.data, loaded_weight, 1, self.tp_size, self.tp_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        out = F.linear(x, self.weight, bias)
        if self.tp_size > 1:
            assert self.all_reduce is not None  # __init__ requires one when tp_size > 1
            out = self.all_reduce(out)
        return out
