"""Linear layers split for tensor parallelism: column, row, fused QKV and merged gate/up.

A column-parallel layer owns a slice of the output features of the full layer
(weight ``[output_size / tp_size, input_size]``) and needs no communication. A row-parallel
layer owns a slice of the input features (weight ``[output_size, input_size / tp_size]``) and
produces a partial sum that ``all_reduce`` adds up across ranks.

Every parameter carries ``weight_loader(param, loaded_weight, shard_id=None)``: it takes the
full tensor from a checkpoint and copies this rank's slice into ``param``. Fused layers take a
``shard_id`` naming which checkpoint tensor arrives (``"q"``/``"k"``/``"v"``, or the index of a
merged output). A tensor of the wrong shape raises ``ValueError``; the caller adds its name.

How a layer stores its weight and multiplies by it is its ``linear_method``, chosen when the
layer is built: ``UnquantizedLinearMethod`` (the compute dtype) or an FP8 method
(``layers/quantization/fp8.py``). After the checkpoint is in, ``finish_loading`` lets each
method turn what it loaded into the form its forward reads.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import nn

from pagedserve.platform import platform_for

AllReduce = Callable[[torch.Tensor], torch.Tensor]
ShardId = str | int | None
WeightLoader = Callable[[nn.Parameter, torch.Tensor, ShardId], None]
# The attribute of a parameter that holds its loader (nn.Parameter declares no such field).
_WEIGHT_LOADER_ATTR = "weight_loader"


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what}: {numerator} is not divisible by tp_size {denominator}")
    return numerator // denominator


def narrow_shard(
    loaded: torch.Tensor, local_shape: tuple[int, ...], dim: int, num_shards: int, index: int
) -> torch.Tensor:
    """Slice ``index`` of ``loaded``, cut into ``num_shards`` parts of ``local_shape`` along
    ``dim``; ValueError when ``loaded`` is not ``num_shards`` such parts."""
    full = list(local_shape)
    full[dim] *= num_shards
    if list(loaded.shape) != full:
        raise ValueError(f"expected a tensor of shape {tuple(full)}, got {tuple(loaded.shape)}")
    size = local_shape[dim]
    return loaded.narrow(dim, index * size, size)


def copy_shard(
    dst: torch.Tensor, loaded: torch.Tensor, dim: int, num_shards: int, index: int
) -> None:
    """Copy slice ``index`` of ``loaded`` (cut into ``num_shards`` equal parts along ``dim``)."""
    dst.copy_(narrow_shard(loaded, tuple(dst.shape), dim, num_shards, index))


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


class ShardRows(NamedTuple):
    """Where one checkpoint tensor's rows (output features) go on this rank."""

    offset: int
    """First row of the rank's parameter that the tensor's slice fills."""
    size: int
    """Rows of the slice."""
    num_shards: int
    """Equal parts the checkpoint tensor's rows are cut into (1: the rank takes them all)."""
    part: int
    """The part this rank takes."""


class LinearMethod(Protocol):
    """How a linear layer holds its weight and applies it (see the module docstring)."""

    def create_weights(self, layer: LinearBase, dtype: torch.dtype, device: torch.device) -> None:
        """Register ``layer.weight`` (and whatever else the method needs) with loaders."""

    def apply(
        self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [..., input_size_per_rank] -> [..., output_size_per_rank] in x's dtype."""

    def finish_loading(self, layer: LinearBase) -> None:
        """Once every checkpoint tensor is loaded: bring the parameters into forward form."""


@dataclass(frozen=True)
class UnquantizedLinearMethod:
    """The weight in the compute dtype; the platform's ``dense_linear`` (``F.linear``, or on
    the CPU a kernel for few-row bf16 inputs)."""

    def create_weights(self, layer: LinearBase, dtype: torch.dtype, device: torch.device) -> None:
        layer.weight = new_parameter(layer.weight_shape, dtype, device, layer.weight_loader)
        layer.dense_linear = platform_for(device).dense_linear()

    def apply(
        self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return layer.dense_linear(x, layer.weight, bias)

    def finish_loading(self, layer: LinearBase) -> None:
        return None


UNQUANTIZED = UnquantizedLinearMethod()


class LinearBase(nn.Module, abc.ABC):
    """What column- and row-parallel layers share: the rank's weight shape, the bias, the
    loader that cuts a checkpoint tensor down to this rank's slice, and the linear method."""

    weight: nn.Parameter
    """[output_size_per_rank, input_size_per_rank]; its dtype is the linear method's."""
    dense_linear: Callable[..., torch.Tensor]
    """The platform's matmul (``F.linear``'s signature), set by the unquantized method."""
    lora: nn.Module | None
    """LoRA slots (``lora/layers.py``) whose delta ``forward(x, out)`` adds to the output;
    None unless the engine serves adapters."""

    def __init__(
        self,
        output_size_per_rank: int,
        input_size_per_rank: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        linear_method: LinearMethod,
    ) -> None:
        super().__init__()
        self.lora = None
        self.output_size_per_rank = output_size_per_rank
        self.input_size_per_rank = input_size_per_rank
        self.linear_method = linear_method
        linear_method.create_weights(self, dtype, device)
        if bias:
            self.bias = new_parameter((output_size_per_rank,), dtype, device, self.weight_loader)
        else:
            self.register_parameter("bias", None)

    @property
    def weight_shape(self) -> tuple[int, int]:
        return self.output_size_per_rank, self.input_size_per_rank

    @property
    def shard_ids(self) -> list[ShardId]:
        """The checkpoint tensors the weight is made of, in row order."""
        return [None]

    @abc.abstractmethod
    def shard_rows(self, shard_id: ShardId) -> ShardRows:
        """Where the checkpoint tensor ``shard_id`` goes; ValueError for a shard_id the layer
        does not have."""

    def shard_of(
        self, loaded: torch.Tensor, shard_id: ShardId, local_shape: tuple[int, ...]
    ) -> tuple[int, torch.Tensor]:
        """(first local row, this rank's slice of ``loaded``) for a parameter of
        ``local_shape`` whose rows are output features (the weight, the bias, a scale per
        output channel)."""
        rows = self.shard_rows(shard_id)
        piece_shape = (rows.size, *local_shape[1:])
        return rows.offset, narrow_shard(loaded, piece_shape, 0, rows.num_shards, rows.part)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        offset, piece = self.shard_of(loaded_weight, shard_id, tuple(param.shape))
        param.data.narrow(0, offset, piece.shape[0]).copy_(piece)


class ColumnParallelLinear(LinearBase):
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
        linear_method: LinearMethod = UNQUANTIZED,
    ) -> None:
        self.input_size = input_size
        self.output_size = output_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        per_rank = divide(output_size, tp_size, type(self).__name__)
        super().__init__(per_rank, input_size, bias, dtype, device, linear_method)

    def shard_rows(self, shard_id: ShardId) -> ShardRows:
        _check_unfused(shard_id, type(self).__name__)
        return ShardRows(0, self.output_size_per_rank, self.tp_size, self.tp_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear_method.apply(self, x, self.bias)
        return out if self.lora is None else self.lora(x, out)


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
        linear_method: LinearMethod = UNQUANTIZED,
    ) -> None:
        name = type(self).__name__
        self.sizes_per_rank = [divide(size, tp_size, name) for size in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, dtype, device, tp_rank, tp_size,
                         linear_method)

    @property
    def shard_ids(self) -> list[ShardId]:
        return list(range(len(self.sizes_per_rank)))

    def shard_rows(self, shard_id: ShardId) -> ShardRows:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.sizes_per_rank):
            raise ValueError(
                f"{type(self).__name__} needs shard_id 0..{len(self.sizes_per_rank) - 1}, "
                f"got {shard_id!r}"
            )
        offset = sum(self.sizes_per_rank[:shard_id])
        return ShardRows(offset, self.sizes_per_rank[shard_id], self.tp_size, self.tp_rank)


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
        linear_method: LinearMethod = UNQUANTIZED,
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
        super().__init__(hidden_size, output_size, bias, dtype, device, tp_rank, tp_size,
                         linear_method)

    @property
    def shard_ids(self) -> list[ShardId]:
        return ["q", "k", "v"]

    def shard_rows(self, shard_id: ShardId) -> ShardRows:
        kv_shards = self.tp_size // self.kv_replicas
        kv_index = self.tp_rank // self.kv_replicas
        layout = {
            "q": ShardRows(0, self.q_size, self.tp_size, self.tp_rank),
            "k": ShardRows(self.q_size, self.kv_size, kv_shards, kv_index),
            "v": ShardRows(self.q_size + self.kv_size, self.kv_size, kv_shards, kv_index),
        }
        if shard_id not in layout:
            raise ValueError(f"{type(self).__name__} needs shard_id q, k or v, got {shard_id!r}")
        return layout[str(shard_id)]


class RowParallelLinear(LinearBase):
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
        linear_method: LinearMethod = UNQUANTIZED,
    ) -> None:
        if tp_size > 1 and all_reduce is None:
            raise ValueError(f"{type(self).__name__}: tp_size {tp_size} needs an all_reduce")
        self.input_size = input_size
        self.output_size = output_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.all_reduce = all_reduce
        per_rank = divide(input_size, tp_size, type(self).__name__)
        super().__init__(output_size, per_rank, bias, dtype, device, linear_method)

    def shard_rows(self, shard_id: ShardId) -> ShardRows:
        """Every rank holds all output rows (the split is over the input columns)."""
        _check_unfused(shard_id, type(self).__name__)
        return ShardRows(0, self.output_size, 1, 0)

    def shard_of(
        self, loaded: torch.Tensor, shard_id: ShardId, local_shape: tuple[int, ...]
    ) -> tuple[int, torch.Tensor]:
        """Rows whole; a 2-D tensor (the weight) cut to this rank's columns."""
        _check_unfused(shard_id, type(self).__name__)
        if len(local_shape) == 1:  # the bias, a scale per output channel: not split
            return 0, narrow_shard(loaded, local_shape, 0, 1, 0)
        return 0, narrow_shard(loaded, local_shape, 1, self.tp_size, self.tp_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        out = self.linear_method.apply(self, x, bias)
        if self.lora is not None:  # a partial sum too: the all-reduce adds the ranks' deltas
            out = self.lora(x, out)
        if self.tp_size > 1:
            assert self.all_reduce is not None  # __init__ requires one when tp_size > 1
            out = self.all_reduce(out)
        return out


def finish_loading(model: nn.Module) -> None:
    """Every linear layer's ``linear_method.finish_loading``: once, after all its weights are
    loaded (from a checkpoint or as dummy weights)."""
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.linear_method.finish_loading(module)
