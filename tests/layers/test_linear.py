"""Linear layers: weight loaders fill the right shard; simulated TP ranks add up to the full layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.layers.activation import SiluAndMul
from pagedserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

CPU = torch.device("cpu")
F32 = torch.float32


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _load(layer: torch.nn.Module, name: str, tensor: torch.Tensor, shard_id=None) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor, shard_id)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_column_parallel_ranks_concatenate_to_full(tp_size: int) -> None:
    w, b, x = torch.randn(12, 8), torch.randn(12), torch.randn(5, 8)
    outputs = []
    for rank in range(tp_size):
        layer = ColumnParallelLinear(8, 12, True, F32, CPU, tp_rank=rank, tp_size=tp_size)
        _load(layer, "weight", w)
        _load(layer, "bias", b)
        outputs.append(layer(x))
    torch.testing.assert_close(torch.cat(outputs, dim=-1), F.linear(x, w, b))


@pytest.mark.parametrize("tp_size", [1, 2])
def test_row_parallel_ranks_sum_to_full(tp_size: int) -> None:
    w, b, x = torch.randn(6, 8), torch.randn(6), torch.randn(5, 8)
    total = torch.zeros(5, 6)
    for rank in range(tp_size):
        layer = RowParallelLinear(8, 6, True, F32, CPU, rank, tp_size, all_reduce=_identity)
        _load(layer, "weight", w)
        _load(layer, "bias", b)
        total += layer(x.chunk(tp_size, dim=-1)[rank])  # each rank sees its slice of the input
    torch.testing.assert_close(total, F.linear(x, w, b))


@pytest.mark.parametrize(("num_kv_heads", "tp_size"), [(2, 1), (2, 2), (1, 2)])
def test_qkv_shards(num_kv_heads: int, tp_size: int) -> None:
    head_dim, num_heads, hidden = 4, 4, 8
    wq = torch.randn(num_heads * head_dim, hidden)
    wk, wv = torch.randn(2, num_kv_heads * head_dim, hidden)
    bq, bk, bv = torch.randn(num_heads * head_dim), *torch.randn(2, num_kv_heads * head_dim)
    x = torch.randn(3, hidden)
    for rank in range(tp_size):
        layer = QKVParallelLinear(
            hidden, head_dim, num_heads, num_kv_heads, True, F32, CPU, rank, tp_size
        )
        for shard, weight, bias in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            _load(layer, "weight", weight, shard)
            _load(layer, "bias", bias, shard)
        q, k, v = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        kv_rank = rank // layer.kv_replicas  # with 1 KV head and 2 ranks both hold head 0
        torch.testing.assert_close(q, F.linear(x, wq, bq).chunk(tp_size, -1)[rank])
        num_kv_shards = tp_size // layer.kv_replicas
        torch.testing.assert_close(k, F.linear(x, wk, bk).chunk(num_kv_shards, -1)[kv_rank])
        torch.testing.assert_close(v, F.linear(x, wv, bv).chunk(num_kv_shards, -1)[kv_rank])


@pytest.mark.parametrize("tp_size", [1, 2])
def test_merged_gate_up(tp_size: int) -> None:
    gate, up, x = torch.randn(6, 8), torch.randn(6, 8), torch.randn(3, 8)
    act = SiluAndMul(CPU)
    outputs = []
    for rank in range(tp_size):
        layer = MergedColumnParallelLinear(8, [6, 6], False, F32, CPU, rank, tp_size)
        _load(layer, "weight", gate, 0)
        _load(layer, "weight", up, 1)
        outputs.append(act(layer(x)))
    expected = F.silu(F.linear(x, gate)) * F.linear(x, up)
    torch.testing.assert_close(torch.cat(outputs, dim=-1), expected)


def test_loader_errors() -> None:
    column = ColumnParallelLinear(8, 12, False, F32, CPU)
    with pytest.raises(ValueError, match=r"expected a tensor of shape \(12, 8\), got \(12, 9\)"):
        _load(column, "weight", torch.zeros(12, 9))
    with pytest.raises(ValueError, match="shard_id"):
        _load(column, "weight", torch.zeros(12, 8), "q")
    qkv = QKVParallelLinear(8, 4, 2, 1, False, F32, CPU)
    with pytest.raises(ValueError, match="q, k or v"):
        _load(qkv, "weight", torch.zeros(8, 8))
    with pytest.raises(ValueError, match=r"expected a tensor of shape \(4, 8\)"):
        _load(qkv, "weight", torch.zeros(8, 8), "k")
    merged = MergedColumnParallelLinear(8, [6, 6], False, F32, CPU)
    with pytest.raises(ValueError, match="shard_id 0..1"):
        _load(merged, "weight", torch.zeros(6, 8), 2)


def test_tp_configuration_errors() -> None:
    with pytest.raises(ValueError, match="all_reduce"):
        RowParallelLinear(8, 6, False, F32, CPU, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="not divisible by tp_size 4"):
        ColumnParallelLinear(8, 6, False, F32, CPU, tp_rank=0, tp_size=4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        QKVParallelLinear(8, 4, 6, 3, False, F32, CPU, tp_rank=0, tp_size=2)


def test_silu_and_mul() -> None:
    x = torch.randn(3, 10)
    torch.testing.assert_close(SiluAndMul(CPU)(x), F.silu(x[:, :5]) * x[:, 5:])
