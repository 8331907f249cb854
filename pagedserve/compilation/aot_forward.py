"""Saved forwards: skip Dynamo's trace on a warm start (torch's AOT compile, as vLLM's
``VLLM_USE_AOT_COMPILE`` does).

Cold start: ``trace`` runs Dynamo once through ``aot_compile`` with a backend that only keeps
the graph (``DynamoGraph``), saves the result under the forward's key (``aot_key``) in
``<compile cache dir>/aot_forward/<key>.bin``, then binds ``PiecewiseBackend`` to the graph.
Warm start: ``load`` rebuilds Dynamo's output (bytecode, graph, fake example inputs with the
unbacked token count) from that file and binds the backend the same way; Dynamo does not run.
Both return a callable ``(input_ids, positions) -> hidden_states`` for this model.

Any failure (a torch without the API, an unpicklable graph, a corrupt or foreign file) is the
caller's cue to fall back: ``trace`` and ``load`` raise ``SavedForwardError`` with the reason;
``load`` removes a file it could not use, so the next start writes a fresh one.
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from pagedserve.compilation.aot_artifact import DynamoGraph, register_serializable

AOT_ENV = "PAGEDSERVE_AOT_COMPILE"
"""``0`` turns saved forwards off (Dynamo traces every start); anything else, or unset: on."""
ARTIFACT_DIR = "aot_forward"

Backend = Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]


class SavedForwardError(RuntimeError):
    """A saved forward could not be traced, saved or loaded (the caller falls back)."""


def aot_enabled(env: Mapping[str, str]) -> bool:
    return env.get(AOT_ENV, "1") != "0"


def keep_graph(gm: fx.GraphModule, example_inputs: list[Any]) -> DynamoGraph:
    """The backend ``aot_compile`` runs: keep Dynamo's graph and the fake versions of its
    (real) example inputs, from the fake mode Dynamo traced in; compile nothing yet."""
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        raise SavedForwardError("Dynamo called the backend outside a fake mode")
    fake = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x
            for x in example_inputs]
    return DynamoGraph(gm, fake)


class SavedForwards:
    """The saved forwards of one cache directory."""

    def __init__(self, cache_dir: Path) -> None:
        self.dir = cache_dir / ARTIFACT_DIR

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.bin"

    def load(self, key: str, model: nn.Module, backend: Backend) -> Callable[..., Any] | None:
        """The saved forward of ``key`` with ``backend`` bound to it; None if none is saved."""
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            with open(path, "rb") as f:
                loaded = torch.compiler.load_compiled_function(f)
            _dynamo_graph(loaded).bind(backend)
        except Exception as e:
            path.unlink(missing_ok=True)  # unusable: the next start traces and saves again
            raise SavedForwardError(
                f"could not load {path} ({type(e).__name__}: {e}); removed it") from e
        return _bound(loaded, model)

    def trace(self, traceable: Any, key: str, model: nn.Module, inputs: tuple[torch.Tensor, ...],
              backend: Backend) -> tuple[Callable[..., Any], str | None]:
        """Trace with Dynamo (``traceable``: torch.compile of the forward with ``keep_graph``),
        save, bind ``backend``. Returns the forward and the save error (None when saved); a
        failure before the forward exists raises SavedForwardError."""
        aot_compile = getattr(traceable, "aot_compile", None)
        if aot_compile is None:
            raise SavedForwardError(f"torch {torch.__version__} has no aot_compile")
        try:
            register_serializable()
            compiled = aot_compile((inputs, {}))
            graph = _dynamo_graph(compiled)
        except Exception as e:
            raise SavedForwardError(f"aot_compile failed ({type(e).__name__}: {e})") from e
        # Saved before binding: saving drops the graph's stack metadata, so this start's
        # pieces are compiled from the same graph a warm start loads (same Inductor keys).
        save_error = self._save(compiled, self.path(key))
        try:
            graph.bind(backend)
        except Exception as e:
            raise SavedForwardError(f"the backend failed on the traced graph ({e})") from e
        return _bound(compiled, model), save_error

    def _save(self, compiled: Any, path: Path) -> str | None:
        """Write atomically (a temporary file in the same folder, then ``os.replace``)."""
        tmp = None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{path.name}.", suffix=".tmp")
            os.close(fd)
            compiled.save_compiled_function(tmp)
            os.replace(tmp, path)
        except Exception as e:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            return f"could not save {path} ({type(e).__name__}: {e})"
        return None


def _dynamo_graph(compiled: Any) -> DynamoGraph:
    """The backend output inside torch's ``AOTCompiledFunction`` (``_artifacts.compiled_fn``
    in torch 2.9 to 2.13: the API is experimental, so the shape is checked)."""
    graph = getattr(getattr(compiled, "_artifacts", None), "compiled_fn", None)
    if not isinstance(graph, DynamoGraph):
        raise SavedForwardError(
            f"the compiled function holds {type(graph).__name__}, not a DynamoGraph")
    return graph


def _bound(compiled: Any, model: nn.Module) -> Callable[..., Any]:
    """``compiled`` takes the model as its first argument (it traced ``model.forward``); its
    guards are off, like the JIT path's (``_no_guards``)."""
    compiled.disable_guard_check()
    return functools.partial(compiled, model)
