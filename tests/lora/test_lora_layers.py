"""LoRA slots of one linear layer: the masked all-slots delta equals each token's own
adapter's x @ A^T @ B^T, for fused layers, lower ranks and tensor-parallel slices."""

from __future__ import annotations

import pytest
import torch

from pagedserve.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.layers.quantization.fp8_ops import Fp8Activation, quantize_rows
from pagedserve.lora.layers import LoRASlice, LoRAWeights

CPU = torch.device("cpu")
HIDDEN, HEAD_DIM, HEADS, KV_HEADS = 32, 8, 4, 2
QKV = [LoRASlice("q_proj", "q"), LoRASlice("k_proj", "k"), LoRASlice("v_proj", "v")]
QKV_SIZES = {"q_proj": HEADS * HEAD_DIM, "k_proj": KV_HEADS * HEAD_DIM,
             "v_proj": KV_HEADS * HEAD_DIM}


def _pair(rank: int, in_features: int, out_features: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rank, in_features, generator=g),
            torch.randn(out_features, rank, generator=g))


def _mask(token_slots: list[int], max_loras: int) -> torch.Tensor:
    slots = torch.tensor(token_slots)
    return (slots.unsqueeze(1) == torch.arange(max_loras)).float()  # [T, max_loras]


def _qkv(tp_rank: int = 0, tp_size: int = 1) -> QKVParallelLinear:
    return QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, False, torch.float32, CPU,
                             tp_rank, tp_size)


def test_fused_layer_delta_per_token_adapter() -> None:
    """Two adapters of ranks 4 and 2 in slots 0 and 2 (of 3); adapter B leaves k_proj alone;
    tokens choose slot 0, 2 or none."""
    layer = _qkv()
    adapters = [
        {m: _pair(4, HIDDEN, size, i) for i, (m, size) in enumerate(QKV_SIZES.items())},
        {m: _pair(2, HIDDEN, QKV_SIZES[m], 10 + i) for i, m in enumerate(["q_proj", "v_proj"])},
    ]
    token_slots = [0, 2, -1, 2, 0]
    lora = LoRAWeights(layer, QKV, max_loras=3, max_rank=4, token_mask=_mask(token_slots, 3))
    lora.set_slot(0, adapters[0])
    lora.set_slot(2, adapters[1])
    x = torch.randn(len(token_slots), HIDDEN)
    base = torch.randn(len(token_slots), layer.output_size_per_rank)
    got = lora(x, base)
    for t, slot in enumerate(token_slots):
        want = base[t].clone()
        if slot >= 0:
            adapter = adapters[0 if slot == 0 else 1]
            parts = [x[t] @ adapter[m][0].T @ adapter[m][1].T if m in adapter
                     else torch.zeros(size) for m, size in QKV_SIZES.items()]
            want += torch.cat(parts)
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5)


def test_clear_and_overwrite_slot() -> None:
    layer = RowParallelLinear(HIDDEN, HIDDEN, False, torch.float32, CPU)
    lora = LoRAWeights(layer, [LoRASlice("o_proj", None)], 1, 4, _mask([0, 0], 1))
    x, base = torch.randn(2, HIDDEN), torch.zeros(2, HIDDEN)
    lora.set_slot(0, {"o_proj": _pair(4, HIDDEN, HIDDEN, 0)})
    first = lora(x, base)
    a, b = _pair(3, HIDDEN, HIDDEN, 1)
    lora.set_slot(0, {"o_proj": (a, b)})  # a lower rank: the old rank's last row must go
    torch.testing.assert_close(lora(x, base), x @ a.T @ b.T, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(first, lora(x, base))
    lora.clear_slot(0)
    assert torch.count_nonzero(lora(x, base)) == 0


def _parallel_layer(kind: str, tp_rank: int, tp_size: int):
    if kind == "qkv":
        return _qkv(tp_rank, tp_size)
    if kind == "gate_up":
        return MergedColumnParallelLinear(HIDDEN, [16, 16], False, torch.float32, CPU, tp_rank,
                                          tp_size)
    return RowParallelLinear(16, HIDDEN, False, torch.float32, CPU, tp_rank, tp_size,
                             all_reduce=lambda t: t)


_PARALLEL_CASES = {
    "qkv": (QKV, {m: _pair(4, HIDDEN, size, i) for i, (m, size) in enumerate(QKV_SIZES.items())}),
    "gate_up": ([LoRASlice("gate_proj", 0), LoRASlice("up_proj", 1)],
                {"gate_proj": _pair(4, HIDDEN, 16, 0), "up_proj": _pair(4, HIDDEN, 16, 1)}),
    "down": ([LoRASlice("down_proj", None)], {"down_proj": _pair(4, 16, HIDDEN, 0)}),
}


@pytest.mark.parametrize("kind", list(_PARALLEL_CASES))
def test_tensor_parallel_slices_add_up(kind: str) -> None:
    """Column-parallel ranks' deltas, concatenated per slice, and row-parallel ranks'
    partial deltas, summed, equal the single-rank delta."""
    tp_size, tokens = 2, 3
    slices, weights = _PARALLEL_CASES[kind]
    mask = _mask([0] * tokens, 1)
    full = LoRAWeights(_parallel_layer(kind, 0, 1), slices, 1, 4, mask)
    full.set_slot(0, weights)
    x = torch.randn(tokens, full.layer_in)
    want = full(x, torch.zeros(tokens, full.layer_out))
    ranks = [LoRAWeights(_parallel_layer(kind, r, tp_size), slices, 1, 4, mask)
             for r in range(tp_size)]
    for rank in ranks:
        rank.set_slot(0, weights)
    if kind == "down":  # input columns split: partial sums
        x_parts = x.chunk(tp_size, dim=1)
        got = sum(rank(xp, torch.zeros(tokens, HIDDEN))
                  for rank, xp in zip(ranks, x_parts, strict=True))
    else:  # output rows split per slice: each slice's rows of every rank, in rank order
        outs = [rank(x, torch.zeros(tokens, rank.layer_out)) for rank in ranks]
        sizes = [[rows.size for rows in rank.rows] for rank in ranks]
        pieces = [o.split(s, dim=1) for o, s in zip(outs, sizes, strict=True)]
        got = torch.cat([p[i] for i in range(len(slices)) for p in pieces], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fp8_activation_input_is_dequantized() -> None:
    layer = RowParallelLinear(HIDDEN, HIDDEN, False, torch.float32, CPU)
    lora = LoRAWeights(layer, [LoRASlice("o_proj", None)], 1, 4, _mask([0, 0], 1))
    a, b = _pair(4, HIDDEN, HIDDEN, 0)
    lora.set_slot(0, {"o_proj": (a, b)})
    x = torch.randn(2, HIDDEN)
    q, scale = quantize_rows(x)
    activation = Fp8Activation(q, scale.unsqueeze(-1), torch.float32)
    want = activation.dequantize() @ a.T @ b.T
    torch.testing.assert_close(lora(activation, torch.zeros(2, HIDDEN)), want)
