"""CUDA graph capture and replay, keyed by the padded token count of the forward context.

One ``CUDAGraphWrapper`` wraps one runnable: a piece of the split model (mode PIECEWISE) or the
whole forward (mode FULL). At call time it reads the forward context: when the runner's
``CudaGraphManager`` chose this wrapper's mode, it replays the graph captured for
``num_tokens``, or captures it if a capture phase (``GraphPool.capture_phase``) is running;
otherwise (another mode, or a size without a graph outside a capture phase) it runs the
runnable as it is. Inputs are not copied: every input of a captured region lives at a fixed
address (the runner's persistent buffers, or outputs of the previous captured piece), which
``check_addresses`` verifies in tests. See docs/architecture.md#cuda-graphs.

Captures are cheap by construction: a capture phase runs on one side stream, so each capture
is ``capture_begin`` / ``capture_end`` on the current stream, without the device-wide
synchronize and ``empty_cache`` that ``torch.cuda.graph`` does on entry (with one graph per
piece and capture size those dominated the capture time; ``empty_cache`` also handed back the
blocks the next capture would allocate again).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.attention.forward_context import get_forward_context

# Non-owning tensor views, so captured graph outputs do not pin their memory. A graph's outputs
# live in the graph memory pool; holding them strongly for every capture size would keep every
# size's activations alive at once, while a non-owning view lets the next capture (of a smaller
# size, in the same pool) reuse the memory. Replays of different sizes never overlap, so the
# aliasing is safe (vLLM relies on the same fact).


def weak_ref_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor viewing ``t``'s memory without keeping it alive."""
    storage = t.untyped_storage()
    weak = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    return out.set_(weak, t.storage_offset(), t.shape, t.stride())


def weak_ref_tensors(value: Any) -> Any:
    """Apply ``weak_ref_tensor`` through tuples and lists."""
    if isinstance(value, torch.Tensor):
        return weak_ref_tensor(value)
    if isinstance(value, (tuple, list)):
        return type(value)(weak_ref_tensors(v) for v in value)
    return value


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    output: Any  # non-owning views of the captured outputs
    input_addresses: list[int]


class GraphPool:
    """One memory pool shared by every capture of a model (pieces and full graphs), and the
    side stream its capture phases run on. The worker's ``CudaGraphManager`` owns it and runs
    the capture phases."""

    def __init__(self) -> None:
        self.handle = torch.cuda.graph_pool_handle()
        self.capture_stream: torch.cuda.Stream | None = None
        """Set while a capture phase runs; wrappers capture only then."""
        self._stream: torch.cuda.Stream | None = None

    @contextmanager
    def capture_phase(self, device: torch.device) -> Iterator[torch.cuda.Stream]:
        """Run the enclosed steps (warm-ups, captures, the eager attention in between) on this
        pool's side stream. One stream for every phase, so its cuBLAS workspace is allocated
        once, by the first warm-up, outside any graph."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        stream, main = self._stream, torch.cuda.current_stream(device)
        stream.wait_stream(main)
        self.capture_stream = stream
        try:
            with torch.cuda.stream(stream):
                yield stream
        finally:
            self.capture_stream = None
            main.wait_stream(stream)
            torch.cuda.synchronize(device)


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
            if self.pool.capture_stream is None:  # never capture outside a capture phase
                return self.runnable(*args)
            return self._capture(ctx.num_tokens, args)
        if self.check_addresses:
            now = _tensor_addresses(args)
            if now != entry.input_addresses:
                raise RuntimeError(f"{self.name}: input addresses moved since capture")
        entry.graph.replay()
        return entry.output

    def _capture(self, num_tokens: int, args: tuple) -> Any:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool.handle)
        try:
            output = self.runnable(*args)
        finally:
            graph.capture_end()
        self.entries[num_tokens] = _Entry(graph, weak_ref_tensors(output), _tensor_addresses(args))
        # The strong references go back to the caller for this one forward only.
        return output

    def drop(self, num_tokens: int) -> None:
        """Forget the graph of ``num_tokens`` (its driver memory is freed with it; its pool
        blocks stay in the pool for the next capture)."""
        self.entries.pop(num_tokens, None)


def _tensor_addresses(args: tuple) -> list[int]:
    return [a.data_ptr() for a in args if isinstance(a, torch.Tensor)]
