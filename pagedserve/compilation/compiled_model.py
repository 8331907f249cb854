"""The model forward as the runner calls it: compiled pieces, PIECEWISE and FULL graphs.

``CompiledForward(model, ...)(input_ids, positions)`` returns the hidden states. Which path runs
is decided by the forward context the runner set (the execution mode its ``CudaGraphManager``
chose; see docs/architecture.md#cuda-graphs):
- ``NONE``: the compiled pieces run as they are (or the plain model with ``enforce_eager``);
- ``PIECEWISE``: each compute piece replays its graph for the padded token count, attention
  runs eagerly in between;
- ``FULL``: one graph of the whole forward, attention included (uniform decode batches).

One compile serves every batch: on the first call the token dimension is marked unbacked (no
guards on sizes 0 and 1, no specialization), and Dynamo keeps no guards at all
(``_no_guards``), so nothing the runner changes between calls (the KV-cache tensors bound to
the attention layers, the stream, the inputs' sizes) sends Dynamo back to tracing, and later
calls need no marks. The first call, which compiles, is timed and logged with the compile
cache's hits and misses (``compile_stats``); the backend refuses a second trace (see
``PiecewiseBackend``).

The first call skips Dynamo when a saved forward of this model exists (``aot_forward``: torch's
AOT compile, keyed by ``aot_key``); otherwise it traces through ``aot_compile`` and saves one.
The backend builds its pieces and graph wrappers the same way on every path. If the saved path
fails in any way, one warning is logged and Dynamo's JIT compile (``torch.compile``) runs as
before; ``PAGEDSERVE_AOT_COMPILE=0`` skips the saved path altogether.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedserve.attention.forward_context import get_forward_context
from pagedserve.compilation.aot_forward import (
    SavedForwardError,
    SavedForwards,
    aot_enabled,
    keep_graph,
)
from pagedserve.compilation.aot_key import forward_key, key_factors
from pagedserve.compilation.backend import PiecewiseBackend
from pagedserve.compilation.compile_cache import (
    CacheCounts,
    read_cache_counts,
    use_compile_cache_dir,
)
from pagedserve.compilation.cuda_graph import CUDAGraphWrapper, GraphPool
from pagedserve.compilation.phase_log import log_phase

logger = logging.getLogger(__name__)


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


def _aot_compile_enabled() -> Any:
    """torch.compile attaches ``aot_compile`` to what it returns only with Dynamo's
    ``enable_aot_compile`` (on by default from torch 2.10; absent before 2.9)."""
    if not hasattr(torch._dynamo.config, "enable_aot_compile"):
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(enable_aot_compile=True)


def _no_guards(guard_entries: list[Any]) -> list[bool]:
    """Dynamo guard filter: keep none. The runner always calls with int token ids and int64
    positions of one dynamic length under inference mode; the model's modules never change
    after loading. (vLLM drops its guards the same way.)"""
    return [False] * len(guard_entries)


@dataclass(frozen=True)
class CompileStats:
    seconds: float
    """The first call: Dynamo's trace, the backend, and the first run of the pieces."""
    backend_seconds: float
    """Splitting and compiling (or loading from the cache) the pieces."""
    num_pieces: int
    num_distinct_pieces: int
    cache: CacheCounts
    cache_dir: Path | None
    """Inductor's cache directory (None with eager pieces)."""


class CompiledForward:
    def __init__(self, model: nn.Module, piece_compiler: str, graph_pool: GraphPool | None,
                 one_token_forward: Callable[..., Any] | None = None) -> None:
        """``graph_pool``: where the graph wrappers capture (the runner's graph manager owns
        it); None: no wrappers, the compiled forward runs as it is."""
        self.model = model
        self.one_token_forward = one_token_forward
        """Runs one-token steps in place of the compiled forward (``model/gemv_decode.py``)."""
        self.piece_compiler = piece_compiler
        self.cache_dir = use_compile_cache_dir() if piece_compiler == "inductor" else None
        self.graph_pool = graph_pool
        self.backend = self._new_backend()
        self.saved = SavedForwards(use_compile_cache_dir()) if aot_enabled(os.environ) else None
        """Where saved forwards live; None: off (``PAGEDSERVE_AOT_COMPILE=0``)."""
        self.forward: Callable[..., Any] | None = None
        """Set by the first call: the saved (loaded or AOT-traced) forward, or Dynamo's."""
        self.aot_artifact: Path | None = None
        """The saved forward the first call loaded (Dynamo skipped), else None."""
        self.full_graph: CUDAGraphWrapper | None = None
        self.verify_graph: CUDAGraphWrapper | None = None
        """FULL graphs of batches whose requests each verify drafts (1 + k tokens), added by
        ``add_verify_graphs``: keyed by token count like ``full_graph``'s, so kept apart."""
        if self.graph_pool is not None:
            self.full_graph = CUDAGraphWrapper(self._run_full, "FULL", self.graph_pool, "full")
        self.compile_stats: CompileStats | None = None
        """Set by the first call (the compile)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        if self.compile_stats is None:
            return self._first_call(input_ids, positions)
        if self.full_graph is not None:
            if self.verify_graph is not None and get_forward_context().query_len > 1:
                return self.verify_graph(input_ids, positions)
            return self.full_graph(input_ids, positions)
        return self._run_full(input_ids, positions)

    def add_verify_graphs(self) -> None:
        """Speculative decoding: FULL forwards of 1 + k tokens per request get graphs of their
        own (the forward context's ``query_len`` picks them)."""
        if self.graph_pool is not None:
            self.verify_graph = CUDAGraphWrapper(self._run_full, "FULL", self.graph_pool,
                                                 "verify")

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        assert self.forward is not None  # set by the first call
        return self.forward(input_ids, positions)

    def _run_full(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        """What the FULL graph captures: the one-token forward for one token (when there is
        one), else the compiled forward. Outside FULL mode the wrapper runs this too, and so
        does a compiled forward without graphs."""
        if self.one_token_forward is not None and input_ids.shape[0] == 1:
            return self.one_token_forward(input_ids, positions)
        return self._run(input_ids, positions)

    def _first_call(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        torch._dynamo.decorators.mark_unbacked(input_ids, 0)
        torch._dynamo.decorators.mark_unbacked(positions, 0)
        before, start = read_cache_counts(), time.perf_counter()
        self.forward = self._compile((input_ids, positions))
        output = self.forward(input_ids, positions)
        stats = CompileStats(
            seconds=time.perf_counter() - start,
            backend_seconds=self.backend.compile_seconds,
            num_pieces=self.backend.num_pieces,
            num_distinct_pieces=self.backend.num_distinct_pieces,
            cache=read_cache_counts() - before,
            cache_dir=self.cache_dir,
        )
        self.compile_stats = stats
        self._log_compile(stats)
        return output

    def _compile(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> Callable[..., Any]:
        """The saved forward (loaded, or traced and saved), else Dynamo's JIT compile. Every
        failure of the saved path logs one warning and falls back to the next."""
        if self.saved is not None:
            try:
                key = forward_key(key_factors(self.model, self.piece_compiler, inputs))
                return self._saved_forward(self.saved, key, inputs)
            except (SavedForwardError, ValueError) as e:
                logger.warning("saved forward not used, Dynamo traces: %s", e)
                self.backend = self._new_backend()
        return self._dynamo(self.backend)

    def _saved_forward(self, saved: SavedForwards, key: str,
                       inputs: tuple[torch.Tensor, torch.Tensor]) -> Callable[..., Any]:
        try:
            loaded = saved.load(key, self.model, self.backend)
        except SavedForwardError as e:
            logger.warning("%s; Dynamo traces", e)
            self.backend = self._new_backend()
            loaded = None
        if loaded is not None:
            self.aot_artifact = saved.path(key)
            return loaded
        forward, save_error = saved.trace(self._dynamo(keep_graph), key, self.model, inputs,
                                          self.backend)
        if save_error is not None:
            logger.warning("saved forward: %s; the next start traces again", save_error)
        return forward

    def _new_backend(self) -> PiecewiseBackend:
        """A backend with no pieces yet (after a failed path, which may have bound the previous
        one to its graph, the next path starts from a fresh one)."""
        return PiecewiseBackend(self.piece_compiler, self.graph_pool)

    def _dynamo(self, backend: Any) -> Any:
        """torch.compile of this model's own forward (see ``_own_forward``), guard-free."""
        with _aot_compile_enabled():
            return torch.compile(_own_forward(self.model), backend=backend, fullgraph=True,
                                 options={"guard_filter_fn": _no_guards})

    def _log_compile(self, stats: CompileStats) -> None:
        c = stats.cache
        if self.aot_artifact is not None:
            dynamo = f"Dynamo skipped (AOT artifact {self.aot_artifact})"
        else:
            dynamo = f"Dynamo {stats.seconds - stats.backend_seconds:.1f} s"
        log_phase(
            logger, "compile", stats.seconds,
            f"{dynamo}, backend "
            f"{stats.backend_seconds:.1f} s for {stats.num_distinct_pieces} distinct of "
            f"{self.backend.num_pieces - self.backend.num_attention_pieces} compute pieces; "
            f"AOT-autograd cache {c.aot_hits} hits / {c.aot_misses} "
            f"misses, FX-graph cache {c.fx_hits} hits / {c.fx_misses} misses / {c.fx_bypasses} "
            f"bypasses, in {stats.cache_dir}",
            backend_seconds=stats.backend_seconds, aot_hits=c.aot_hits, aot_misses=c.aot_misses,
            fx_hits=c.fx_hits, fx_misses=c.fx_misses, fx_bypasses=c.fx_bypasses,
            distinct_pieces=stats.num_distinct_pieces, pieces=stats.num_pieces,
            dynamo_skipped=self.aot_artifact is not None,
        )  # fmt: skip

    @property
    def piecewise_wrappers(self) -> list[CUDAGraphWrapper]:
        return self.backend.wrappers

    def captured_sizes(self) -> dict[str, list[int]]:
        """Capture sizes per mode, for logs and tests."""
        pieces = self.backend.wrappers[0].entries if self.backend.wrappers else {}
        full = self.full_graph.entries if self.full_graph is not None else {}
        return {"PIECEWISE": sorted(pieces), "FULL": sorted(full)}
