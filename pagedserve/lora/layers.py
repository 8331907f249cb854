"""One linear layer's LoRA slots and the delta they add to its output.

Every adapter slot's A and B are stacked into two matrices, and a step computes the delta of
all slots for every token, then keeps each token's own slot by a mask:

    shrunk = x @ A_all^T                    [T, S * L * R]   (S slices, L slots, rank R)
    shrunk *= token_mask per slot           (1 for the token's slot, 0 elsewhere)
    out   += shrunk @ B_all^T               [T, out]

Two plain matmuls, whatever the batch's mix of adapters: the same code runs eagerly, compiled
and inside CUDA graphs (the mask is a persistent buffer the runner fills before each step),
and on every device. The price is computing every slot for every token: L x R extra columns
per slice, a few percent of the layer's own work at the defaults (max_loras 1, rank 16).

A fused layer (q | k | v, gate | up) has one slice per checkpoint module; B is block-diagonal
over the slices, so one matmul writes each slice's rows from its own part of ``shrunk``.
Adapters of a lower rank than R fill their slot's first rows of A (and columns of B) and leave
the rest zero.

Tensor parallelism splits the slots as the layer splits its weight: a column-parallel layer
keeps its rows of B (A whole), a row-parallel one its columns of A (B whole); the row-parallel
delta is a partial sum like the layer's own output, and the layer's all-reduce adds it up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.layers.linear import LinearBase, RowParallelLinear, ShardId, narrow_shard
from pagedserve.layers.quantization.fp8_ops import Fp8Activation


@dataclass(frozen=True)
class LoRASlice:
    """One checkpoint module of a linear layer (``q_proj`` of ``qkv_proj``)."""

    module: str
    """The adapter's module name (``adapter.LORA_MODULES``)."""
    shard_id: ShardId
    """The layer's shard id of that module (``"q"``, 0, None)."""


class LoRAWeights(nn.Module):
    """The LoRA slots of one linear layer (``layer.lora``); ``forward(x, out)`` adds the delta."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    token_mask: torch.Tensor

    def __init__(
        self,
        layer: LinearBase,
        slices: list[LoRASlice],
        max_loras: int,
        max_rank: int,
        token_mask: torch.Tensor,
    ) -> None:
        """``token_mask`` [max_num_tokens, max_loras]: the runner's buffer, shared by every
        layer (row t: 1 in the column of token t's slot, 0 elsewhere); its dtype is the one
        the slots are kept and multiplied in."""
        super().__init__()
        self.layer_out = layer.output_size_per_rank
        self.layer_in = layer.input_size_per_rank
        self.slices = slices
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.row_parallel = isinstance(layer, RowParallelLinear)
        self.tp_rank = getattr(layer, "tp_rank", 0)
        self.tp_size = getattr(layer, "tp_size", 1)
        self.rows = [layer.shard_rows(s.shard_id) for s in slices]
        width = len(slices) * max_loras * max_rank
        dtype, device = token_mask.dtype, token_mask.device
        # Buffers, not parameters: the checkpoint loader never sees them.
        self.register_buffer("lora_a", torch.zeros(width, self.layer_in, dtype=dtype,
                                                   device=device), persistent=False)
        # lora_a [S * L * R, in_per_rank]: row (s * L + l) * R + i is slot l's row i of slice s
        self.register_buffer("lora_b", torch.zeros(self.layer_out, width, dtype=dtype,
                                                   device=device), persistent=False)
        # lora_b [out_per_rank, S * L * R]: slice s's rows read only slice s's columns
        self.register_buffer("token_mask", token_mask, persistent=False)
        # token_mask [max_num_tokens, L], shared

    def _columns(self, index: int, slot: int) -> slice:
        start = (index * self.max_loras + slot) * self.max_rank
        return slice(start, start + self.max_rank)

    def set_slot(
        self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Put one adapter in ``slot``: module name -> (A [r, in], B [out, r] scaled), full
        checkpoint shapes; a slice the adapter does not touch is zero."""
        self.clear_slot(slot)
        for index, (s, rows) in enumerate(zip(self.slices, self.rows, strict=True)):
            if s.module not in weights:
                continue
            a, b = weights[s.module]
            rank = a.shape[0]
            if self.row_parallel:  # the rank's input columns of A; B whole
                a = narrow_shard(a, (rank, self.layer_in), 1, self.tp_size, self.tp_rank)
            else:  # the rank's output rows of B (this slice's part of them); A whole
                b = narrow_shard(b, (rows.size, rank), 0, rows.num_shards, rows.part)
            cols = self._columns(index, slot)
            self.lora_a[cols][:rank].copy_(a)
            self.lora_b[rows.offset:rows.offset + b.shape[0], cols][:, :rank].copy_(b)

    def clear_slot(self, slot: int) -> None:
        for index in range(len(self.slices)):
            cols = self._columns(index, slot)
            self.lora_a[cols].zero_()
            self.lora_b[:, cols].zero_()

    def forward(self, x: torch.Tensor | Fp8Activation, out: torch.Tensor) -> torch.Tensor:
        """x [T, in_per_rank] (an FP8 activation is dequantized first), out [T, out_per_rank]
        (the layer's output before any all-reduce) -> out + every token's delta."""
        if isinstance(x, Fp8Activation):
            x = x.dequantize()
        num_tokens = x.shape[0]
        shrunk = torch.nn.functional.linear(x.to(self.lora_a.dtype), self.lora_a)
        # shrunk [T, S * L * R]
        mask = self.token_mask[:num_tokens].view(num_tokens, 1, self.max_loras, 1)
        shrunk = (shrunk.view(num_tokens, len(self.slices), self.max_loras, self.max_rank)
                  * mask).view(num_tokens, -1)
        delta = torch.nn.functional.linear(shrunk, self.lora_b)  # [T, out_per_rank]
        return out + delta.to(out.dtype)
