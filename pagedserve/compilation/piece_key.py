"""A structural key of a compute piece, so identical pieces are compiled once.

Between two attention ops a decoder sits as "end of layer i + start of layer i + 1"; with 32
layers, 31 of the 33 compute pieces are the same code on different weights. The weights are
graph inputs (Dynamo lifts parameters to placeholders), so one compiled callable serves every
such piece when it is called with that piece's own arguments. Compiling each distinct piece
once turns 33 Inductor compiles (or, warm, 33 cache loads) into 3.

Two pieces get the same key exactly when they run the same operations on inputs of the same
metadata: the key covers every node's kind, target and arguments (nodes referred to by
position, never by name, since names carry layer numbers) and every example input's dtype,
shape, stride, storage offset and device (symbolic sizes by their symbol), and which inputs
share a storage. Attributes read with
``get_attr`` keep their qualified names, so pieces reading different constants never share.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx


def _target_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):  # call_method, call_module, get_attr, placeholder, output
        return target if node.op != "placeholder" else ""
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__qualname__', repr(target))}"


def _input_meta(value: Any, storage_index: int) -> str:
    if isinstance(value, torch.Tensor):
        return (f"T({value.dtype},{tuple(value.shape)},{value.stride()},"
                f"{value.storage_offset()},{value.device},{value.requires_grad},"
                f"storage {storage_index})")
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return f"S({value})"
    return f"V({type(value).__name__}:{value!r})"


def _storage_indices(values: Sequence[Any]) -> list[int]:
    """For each input, the position of the first input sharing its storage (-1 for
    non-tensors): the compiled code may rely on which inputs alias each other."""
    first: dict[int, int] = {}
    indices = []
    for i, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            indices.append(first.setdefault(value.untyped_storage()._cdata, i))
        else:
            indices.append(-1)
    return indices


def piece_key(piece: fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    """sha256 over the piece's graph structure and its example inputs' metadata."""
    position: dict[fx.Node, int] = {}
    lines = []
    for i, node in enumerate(piece.graph.nodes):
        position[node] = i
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{position[n]}")
        lines.append(f"{node.op}|{_target_name(node)}|{args!r}")
    indices = _storage_indices(example_inputs)
    lines.extend(_input_meta(v, i) for v, i in zip(example_inputs, indices, strict=True))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()
