"""piece_key: equal for the same code on different weights, different for anything else."""

from __future__ import annotations

import torch
from torch import fx, nn

from pagedserve.compilation.piece_key import piece_key


class _Block(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, w) * torch.rsqrt(x.pow(2).mean(-1, True) + self.eps)


def _traced(eps: float, rename: str = "") -> fx.GraphModule:
    gm = fx.symbolic_trace(_Block(eps))
    for node in gm.graph.nodes:  # layer-specific names, as Dynamo gives them
        if node.op != "output":
            node.name = f"{node.name}{rename}"
    gm.recompile()
    return gm


def _inputs(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.zeros(3, 4, dtype=dtype), torch.zeros(4, 4, dtype=dtype)]


def test_same_code_on_other_names_and_weights_shares_a_key() -> None:
    a = piece_key(_traced(1e-6, "_layer_1"), _inputs())
    b = piece_key(_traced(1e-6, "_layer_2"), [torch.ones(3, 4), torch.randn(4, 4)])
    assert a == b


def test_constants_and_input_metadata_change_the_key() -> None:
    base = piece_key(_traced(1e-6), _inputs())
    assert piece_key(_traced(1e-5), _inputs()) != base  # another eps
    assert piece_key(_traced(1e-6), _inputs(torch.bfloat16)) != base  # another dtype
    wide = [torch.zeros(3, 8), torch.zeros(4, 8)]
    assert piece_key(_traced(1e-6), wide) != base  # another shape
    strided = [torch.zeros(4, 3).t(), torch.zeros(4, 4)]
    assert piece_key(_traced(1e-6), strided) != base  # another layout
    storage = torch.zeros(28)
    aliased = [storage[:12].view(3, 4), storage[12:].view(4, 4)]  # offsets differ from base
    separate = [torch.zeros(28)[:12].view(3, 4), torch.zeros(28)[12:].view(4, 4)]
    assert piece_key(_traced(1e-6), aliased) != piece_key(_traced(1e-6), separate)
