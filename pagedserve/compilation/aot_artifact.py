"""The backend's output as torch's AOT compile saves it: Dynamo's graph, not compiled code.

``torch.compile(...).aot_compile(...)`` traces the forward with Dynamo and hands the graph to a
backend whose result must be a ``SerializableCallable``; ``save_compiled_function`` stores
Dynamo's bytecode, guards and that callable's bytes, and ``load_compiled_function`` rebuilds
all of it without tracing. ``DynamoGraph`` is that callable for ``PiecewiseBackend``: it holds
the traced ``GraphModule`` and the backend's (fake) example inputs and serializes those with
torch's ``GraphPickler`` (the fake tensors' metadata, the shape environment with its unbacked
token-count symbol, the graph's nodes). Compiled pieces and CUDA-graph wrappers live in one
process only, so they are never saved: after a load (and after the trace, so that both starts
run the same code) ``bind`` runs the backend on the graph, which compiles its pieces or, warm,
loads them from Inductor's cache.

A ``DynamoGraph`` runs only once bound; calling it before raises a RuntimeError.
"""

from __future__ import annotations

import inspect
import pickle
from collections.abc import Callable, Sequence
from typing import Any
from unittest.mock import patch

from torch import fx

FORMAT_VERSION = 1
"""Bumped when the saved layout below changes (it is part of the artifact key as well)."""

_DROPPED_NODE_META = ("source_fn_stack", "nn_module_stack", "fwd_source_fn_stack", "stack_trace")


def register_serializable() -> None:
    """Make ``DynamoGraph`` a (virtual) ``SerializableCallable``, as ``aot_compile`` requires of
    a backend's output. Done on first use, not at import: importing Dynamo costs a second,
    which eager engines need not pay. Raises ImportError on a torch without the protocol."""
    from torch._dynamo.aot_compile_types import SerializableCallable

    SerializableCallable.register(DynamoGraph)


class DynamoGraph:
    """Dynamo's traced forward graph and example inputs; runs the backend's output once bound.
    Implements torch's ``SerializableCallable`` protocol (see ``register_serializable``)."""

    def __init__(self, graph_module: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        self.graph_module = graph_module
        self.example_inputs = list(example_inputs)
        """Fake tensors (weights, input_ids [u0], positions [u0]) and symbolic ints."""
        self.runnable: Callable[..., Any] | None = None
        """Set by ``bind``: the backend's split graph."""

    def __call__(self, *args: Any) -> Any:
        if self.runnable is None:
            raise RuntimeError("DynamoGraph: called before bind(backend)")
        return self.runnable(*args)

    def bind(self, backend: Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]) -> None:
        """Run ``backend`` on the graph, under a tracing context of the inputs' fake mode (as
        Dynamo calls a backend)."""
        from torch._guards import TracingContext, detect_fake_mode, tracing

        fake_mode = detect_fake_mode(self.example_inputs)
        if fake_mode is None:
            raise RuntimeError("DynamoGraph: the example inputs hold no fake tensor")
        with tracing(TracingContext(fake_mode)):
            self.runnable = backend(self.graph_module, self.example_inputs)

    @classmethod
    def serialize_compile_artifacts(cls, fn: DynamoGraph) -> bytes:
        return dumps_graph(fn.graph_module, fn.example_inputs)

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> DynamoGraph:
        return loads_graph(data)


def dumps_graph(graph_module: fx.GraphModule, example_inputs: Sequence[Any]) -> bytes:
    """Pickle the graph and its example inputs together, so they share one shape environment
    and their tensors keep their identities (a weight used twice stays one tensor)."""
    from torch.fx._graph_pickler import GraphPickler, Options

    for node in graph_module.graph.nodes:
        for key in _DROPPED_NODE_META:  # stacks point at modules and frames: not picklable
            node.meta.pop(key, None)
    base = GraphPickler.reducer_override

    def reducer_override(pickler: GraphPickler, obj: Any) -> Any:
        return _extra_reduce(obj) or base(pickler, obj)

    options = Options(ops_filter=None)  # custom ops (attention, collectives) are fine here
    with patch.object(GraphPickler, "reducer_override", reducer_override):
        payload = GraphPickler.dumps((graph_module, list(example_inputs)), options)
    return pickle.dumps({"format": FORMAT_VERSION, "graph": payload})


def loads_graph(data: bytes) -> DynamoGraph:
    """The inverse of ``dumps_graph``, in a fresh fake mode and shape environment."""
    from torch._subclasses import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    state = pickle.loads(data)
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise ValueError(f"saved forward graph: format is not {FORMAT_VERSION}")
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    loaded = GraphPickler.loads(state["graph"], fake_mode)
    if not (isinstance(loaded, tuple) and len(loaded) == 2):
        raise ValueError("saved forward graph: not a (graph module, example inputs) pair")
    graph_module, example_inputs = loaded
    graph_module.recompile()
    return DynamoGraph(graph_module, example_inputs)


def _extra_reduce(obj: Any) -> tuple | None:
    """Two cases GraphPickler misses (vLLM pickles Dynamo graphs the same way): sympy
    functions torch defines (``FloorDiv``, ``Mod``...) go by their registered name, and a fake
    mode met outside a tensor is dropped (the loader brings its own)."""
    import sympy
    from torch._subclasses import FakeTensorMode

    if (
        inspect.isclass(obj)
        and issubclass(obj, sympy.Function)
        and hasattr(obj, "_torch_unpickler")
        and hasattr(obj, "_torch_handler_name")
    ):
        return obj._torch_unpickler, (obj._torch_handler_name,)
    if isinstance(obj, FakeTensorMode):
        return type(None), ()
    return None
