"""The torch.compile backend: split at attention, compile each piece, wrap it for graphs.

Dynamo traces the model's forward once with a dynamic token dimension. This backend splits the
traced graph at the attention ops, compiles every compute piece for the general (symbolic)
shape (Inductor, or kept as traced FX code with ``piece_compiler="eager"``), and on CUDA wraps
each compute piece in a PIECEWISE ``CUDAGraphWrapper``. Attention pieces stay eager.

Identical pieces (the decoder layers between two attention ops, see ``piece_key``) are compiled
once and share the compiled callable; each piece still gets its own graph wrapper, since its
graphs hold its own weights' addresses.

One backend compiles once. ``CompiledForward`` drops every Dynamo guard and marks the token
dimension dynamic on its first call only, so a second trace (only possible after
``torch._dynamo.reset()``) would specialize to one batch size and then serve every size: the
backend refuses it with a RuntimeError instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import fx

from pagedserve.compilation.cuda_graph import CUDAGraphWrapper, GraphPool
from pagedserve.compilation.piece_key import piece_key
from pagedserve.compilation.split import split_graph

logger = logging.getLogger(__name__)

PIECE_COMPILERS = ("inductor", "eager")


class PiecewiseBackend:
    """A torch.compile backend. ``graph_pool`` None: no graph wrappers (CPU, or eager mode)."""

    def __init__(self, piece_compiler: str, graph_pool: GraphPool | None) -> None:
        if piece_compiler not in PIECE_COMPILERS:
            raise ValueError(f"piece_compiler: {piece_compiler!r} is not one of {PIECE_COMPILERS}")
        self.piece_compiler = piece_compiler
        self.graph_pool = graph_pool
        self.wrappers: list[CUDAGraphWrapper] = []
        """One PIECEWISE graph wrapper per compute piece, in execution order."""
        self.num_compiles = 0
        self.num_pieces = 0
        self.num_attention_pieces = 0
        self.num_distinct_pieces = 0
        """Compute pieces compiled; the others reuse one of these (same piece_key)."""
        self.compile_seconds = 0.0
        self._compiled: dict[str, Callable[..., Any]] = {}  # piece_key -> compiled callable

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if self.num_compiles:
            raise RuntimeError(
                "the model was traced a second time (torch._dynamo.reset()?): a backend compiles "
                "once; build a new CompiledForward instead"
            )
        start = time.perf_counter()
        self.num_compiles += 1
        split_gm, pieces = split_graph(gm)
        compute = {p.name for p in pieces if not p.is_splitting_op}
        self.num_pieces = len(pieces)
        self.num_attention_pieces = len(pieces) - len(compute)
        _PieceCompiler(split_gm, compute, self).run(*example_inputs)
        self.num_distinct_pieces = len(self._compiled)
        self.compile_seconds = time.perf_counter() - start
        logger.info(
            "compiled %d pieces (%d attention, %d distinct compute pieces) with %s in %.1f s",
            len(pieces), self.num_attention_pieces, self.num_distinct_pieces,
            self.piece_compiler, self.compile_seconds,
        )  # fmt: skip
        return split_gm

    def compile_piece(self, name: str, piece: fx.GraphModule, args: tuple) -> Callable[..., Any]:
        key = piece_key(piece, args)
        runnable = self._compiled.get(key)
        if runnable is None:
            runnable = self._compile(piece, args)
            self._compiled[key] = runnable
        if self.graph_pool is None:
            return runnable
        wrapper = CUDAGraphWrapper(runnable, "PIECEWISE", self.graph_pool, name)
        self.wrappers.append(wrapper)
        return wrapper

    def _compile(self, piece: fx.GraphModule, args: tuple) -> Callable[..., Any]:
        if self.piece_compiler == "inductor":
            from torch._inductor.compile_fx import compile_fx

            # A graph module compiles to a callable (the str / list forms are AOT-Inductor's).
            return cast(Callable[..., Any], compile_fx(piece, list(args)))
        return piece


class _PieceCompiler(torch.fx.Interpreter):
    """Runs the split graph on the (fake) example inputs; each compute piece is compiled with
    the inputs it receives there and swapped in place."""

    def __init__(self, split_gm: fx.GraphModule, compute: set[str], backend: PiecewiseBackend):
        super().__init__(split_gm)
        self.compute = compute
        self.backend = backend

    def run(
        self,
        *args: Any,
        initial_env: dict[fx.Node, Any] | None = None,
        enable_io_processing: bool = True,
    ) -> Any:
        from torch._guards import detect_fake_mode

        fake_mode = detect_fake_mode(args)
        if fake_mode is None:
            return super().run(
                *args, initial_env=initial_env, enable_io_processing=enable_io_processing
            )
        fake_args = [fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with fake_mode:
            return super().run(
                *fake_args, initial_env=initial_env, enable_io_processing=enable_io_processing
            )

    def call_module(self, target: fx.node.Target, args: tuple, kwargs: dict) -> Any:
        output = super().call_module(target, args, kwargs)  # asserts a str target
        if isinstance(target, str) and target in self.compute:
            piece = self.fetch_attr(target)
            compiled = self.backend.compile_piece(target, piece, args)
            setattr(self.module, target, _CallableModule(compiled))
        return output


class _CallableModule(torch.nn.Module):
    """Holds a compiled callable where the split graph expects a submodule."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)
