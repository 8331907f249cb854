"""The model forward as the runner calls it: compiled pieces, PIECEWISE and FULL graphs.

``CompiledForward(model, ...)(input_ids, positions)`` returns the hidden states. Which path runs
is decided by the forward context the runner set (its dispatcher's descriptor):
- ``NONE``: the compiled pieces run as they are (or the plain model with ``enforce_eager``);
- ``PIECEWISE``: each compute piece replays its graph for the padded token count, attention
  runs eagerly in between;
- ``FULL``: one graph of the whole forward, attention included (uniform decode batches).
The token dimension is marked unbacked, so one trace serves every batch size (no guards on
sizes 0 and 1, no recompiles).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from pagedserve.compilation.backend import PiecewiseBackend
from pagedserve.compilation.cuda_graph import CUDAGraphWrapper, GraphPool


def _own_forward(model: nn.Module) -> Any:
    """``model.forward`` bound to a private copy of its code object.

    Dynamo caches compiled code per code object: two models of one class in one process (two
    engines, or an eager and a compiled one) would share a cache, so the second would recompile
    into the first one's backend, or hit the recompile limit and run uncompiled. A private code
    object gives every CompiledForward its own cache and its own backend."""
    fn = type(model).forward
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{id(model):x}")
    own = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    return types.MethodType(own, model)


class CompiledForward:
    def __init__(self, model: nn.Module, piece_compiler: str, use_cuda_graphs: bool) -> None:
        self.model = model
        self.graph_pool = GraphPool() if use_cuda_graphs else None
        self.backend = PiecewiseBackend(piece_compiler, self.graph_pool)
        self.compiled = torch.compile(_own_forward(model), backend=self.backend, fullgraph=True)
        self.full_graph: CUDAGraphWrapper | None = None
        if self.graph_pool is not None:
            self.full_graph = CUDAGraphWrapper(self.compiled, "FULL", self.graph_pool, "full")

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        torch._dynamo.decorators.mark_unbacked(input_ids, 0)
        torch._dynamo.decorators.mark_unbacked(positions, 0)
        if self.full_graph is not None:
            return self.full_graph(input_ids, positions)
        return self.compiled(input_ids, positions)

    @property
    def piecewise_wrappers(self) -> list[CUDAGraphWrapper]:
        return self.backend.wrappers

    def captured_sizes(self) -> dict[str, list[int]]:
        """Capture sizes per mode, for logs and tests."""
        pieces = self.backend.wrappers[0].entries if self.backend.wrappers else {}
        full = self.full_graph.entries if self.full_graph is not None else {}
        return {"PIECEWISE": sorted(pieces), "FULL": sorted(full)}
