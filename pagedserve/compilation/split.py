"""Split a traced model graph at the attention ops.

Attention is the graph boundary (docs/architecture.md#cuda-graphs): every call of a splitting
op becomes a piece of its own, run eagerly between the pieces before and after it, which are
compiled and captured.
With 32 layers this gives 33 compute pieces and 32 attention pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

SPLITTING_OPS = ("pagedserve::unified_attention",)


def is_splitting_node(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name in SPLITTING_OPS
    if isinstance(target, torch._ops.OpOverload):
        return target.name().split(".")[0] in SPLITTING_OPS
    return False


@dataclass(frozen=True)
class Piece:
    name: str  # submodule name in the split graph: submod_{i}
    is_splitting_op: bool


def split_graph(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[Piece]]:
    """Return the split graph (its submodules run in order) and the list of its pieces."""
    piece_of: dict[fx.Node, int] = {}
    piece = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_splitting_node(node):
            piece += 1
            piece_of[node] = piece
            piece += 1
        else:
            piece_of[node] = piece
    split_gm = split_module(gm, gm, lambda n: piece_of[n], keep_original_order=True)
    splitting = {f"submod_{piece_of[n]}" for n in piece_of if is_splitting_node(n)}
    pieces = [
        Piece(name, name in splitting)
        for name, _ in split_gm.named_children()
        if name.startswith("submod_")
    ]
    return split_gm, pieces
