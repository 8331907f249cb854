"""The key of a saved forward: everything that changes what Dynamo traces.

A saved forward (``aot_forward``) replaces Dynamo's trace, and its guards are dropped
(``_no_guards``), so nothing checks it against the model it is loaded for: the key must. It
covers the model's Hugging Face config, the weights' dtype and device type, the tensor-parallel
rank, size and group name (the collectives name their group in the graph), the piece compiler,
the forward's input metadata (dtypes, ranks, devices), the pagedserve and torch versions, the
saved layout, and the source of the code Dynamo traces (``TRACED_SOURCES``). Weights' values
are not part of it: they are graph inputs.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

import pagedserve
from pagedserve.compilation.aot_artifact import FORMAT_VERSION
from pagedserve.layers.linear import LinearBase

PACKAGE_DIR = Path(pagedserve.__file__).resolve().parent
TRACED_SOURCES = ("model", "layers", "attention/layer.py", "distributed/parallel_state.py")
"""Package paths (folders: every ``*.py`` in them) whose code ends up in the traced graph."""


@functools.cache
def source_hash() -> str:
    """``hash_sources`` of this package's traced files, once per process (the files do not
    change under a running engine)."""
    return hash_sources(PACKAGE_DIR, TRACED_SOURCES)


def hash_sources(package_dir: Path, paths: tuple[str, ...]) -> str:
    """sha256 over the relative names and contents of the files under ``paths``."""
    digest = hashlib.sha256()
    for path in paths:
        root = package_dir / path
        files = sorted(root.rglob("*.py")) if root.is_dir() else [root]
        for file in files:
            digest.update(str(file.relative_to(package_dir)).encode() + b"\0")
            digest.update(file.read_bytes() + b"\0")
    return digest.hexdigest()


_WHERE_FROM = ("_name_or_path", "_commit_hash")
"""Config entries naming where a checkpoint came from, not what it computes: a copy of a model
in another folder (or a dummy-weight run from a fresh temporary folder) shares its forward."""


def _hf_config(model: nn.Module) -> dict[str, Any]:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ValueError(f"model: {type(model).__name__} has no Hugging Face config (.config)")
    return {k: v for k, v in config.to_dict().items() if k not in _WHERE_FROM}


def _tensor_parallel(model: nn.Module) -> list[Any]:
    tp = getattr(model, "tp", None)
    if tp is None:
        return [0, 1, ""]
    return [tp.rank, tp.size, tp.group_name]


def _linear_methods(model: nn.Module) -> list[str]:
    """How the linear layers hold their weights (an FP8 model of a bf16 checkpoint has the
    bf16 model's config and first parameter, but not its graph)."""
    return sorted({repr(m.linear_method) for m in model.modules() if isinstance(m, LinearBase)})


def _input_meta(inputs: tuple[torch.Tensor, ...]) -> list[str]:
    return [f"{t.dtype}/{t.dim()}d/{t.device.type}" for t in inputs]


def key_factors(model: nn.Module, piece_compiler: str,
                inputs: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """The factors, as JSON-able values (they are hashed by ``forward_key``)."""
    weight = next(model.parameters())
    return {
        "hf_config": _hf_config(model),
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "dtype": str(weight.dtype),
        "device_type": weight.device.type,
        "tensor_parallel": _tensor_parallel(model),
        "linear_methods": _linear_methods(model),
        "piece_compiler": piece_compiler,
        "inputs": _input_meta(inputs),
        "pagedserve": pagedserve.__version__,
        "torch": torch.__version__,
        "format": FORMAT_VERSION,
        "sources": source_hash(),
    }


def forward_key(factors: dict[str, Any]) -> str:
    """sha256 of the factors' canonical JSON (sorted keys; unknown values by ``str``)."""
    text = json.dumps(factors, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()
