"""CUDA graph capture and replay, keyed by the padded token count of the forward context.

One ``CUDAGraphWrapper`` wraps one runnable: a piece of the split model (mode PIECEWISE) or the
whole forward (mode FULL). At call time it reads the forward context: when the runner's
dispatcher chose this wrapper's mode, it replays the graph captured for ``num_tokens`` (or
captures it, the first time, during the runner's capture phase); otherwise it runs the runnable
as it is. Inputs are not copied: every input of a captured region lives at a fixed address
(the runner's persistent buffers, or outputs of the previous captured piece), which
``check_addresses`` verifies in tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.attention.forward_context import get_forward_context
from pagedserve.compilation.weak_ref import weak_ref_tensors


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    output: Any  # non-owning views of the captured outputs
    input_addresses: list[int]


class GraphPool:
    """One memory pool shared by every capture of a model (pieces and full graphs)."""

    def __init__(self) -> None:
        self.handle = torch.cuda.graph_pool_handle()


class CUDAGraphWrapper:
    def __init__(
        self, runnable: Callable[..., Any], mode: str, pool: GraphPool, name: str
    ) -> None:
        if mode not in ("PIECEWISE", "FULL"):
            raise ValueError(f"mode: a graph wrapper is PIECEWISE or FULL, got {mode!r}")
        self.runnable = runnable
        self.mode = mode
        self.pool = pool
        self.name = name
        self.entries: dict[int, _Entry] = {}
        self.check_addresses = False

    def __call__(self, *args: Any) -> Any:
        ctx = get_forward_context()
        if ctx.cudagraph_mode != self.mode:
            return self.runnable(*args)
        entry = self.entries.get(ctx.num_tokens)
        if entry is None:
            return self._capture(ctx.num_tokens, args)
        if self.check_addresses:
            now = _tensor_addresses(args)
            if now != entry.input_addresses:
                raise RuntimeError(f"{self.name}: input addresses moved since capture")
        entry.graph.replay()
        return entry.output

    def _capture(self, num_tokens: int, args: tuple) -> Any:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool.handle):
            output = self.runnable(*args)
        self.entries[num_tokens] = _Entry(graph, weak_ref_tensors(output), _tensor_addresses(args))
        # The strong references go back to the caller for this one forward only.
        return output


def _tensor_addresses(args: tuple) -> list[int]:
    return [a.data_ptr() for a in args if isinstance(a, torch.Tensor)]
