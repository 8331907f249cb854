"""Stream a checkpoint as ``(hf_name, tensor)`` pairs, file by file: safetensors or GGUF.

Only one tensor at a time is materialised beyond what the consumer keeps.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pagedserve.model.gguf_config import open_gguf
from pagedserve.model.gguf_weights import iterate_gguf_weights
from pagedserve.model.resolve import ResolvedModel, safetensors_files


def _iterate_safetensors(files: list[Path]) -> Iterator[tuple[Path, str, torch.Tensor]]:
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield file, name, f.get_tensor(name)


def iterate_weights_with_files(
    resolved: ResolvedModel,
) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """(file, Hugging Face name, CPU tensor) for every tensor of the checkpoint."""
    if resolved.format == "safetensors":
        yield from _iterate_safetensors(safetensors_files(resolved.path))
    elif resolved.format == "gguf":
        assert resolved.gguf_file is not None  # a gguf ResolvedModel always names its file
        meta = resolved.gguf_meta or open_gguf(resolved.gguf_file)
        for name, tensor in iterate_gguf_weights(meta):
            yield meta.path, name, tensor
    else:
        raise ValueError(f"load_format: {resolved.format!r} has no checkpoint to iterate")


def iterate_weights(resolved: ResolvedModel) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, CPU tensor) for every tensor of the checkpoint, file by file."""
    for _, name, tensor in iterate_weights_with_files(resolved):
        yield name, tensor


class WeightStream:
    """``iterate_weights`` that remembers the file it last read from, so an error raised by the
    consumer (``model.load_weights``: a shape mismatch) can name the file."""

    def __init__(self, resolved: ResolvedModel) -> None:
        self.resolved = resolved
        self.file: Path | None = None
        self.exhausted = False
        """True once every tensor was handed out (a later error is about the whole checkpoint)."""

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for file, name, tensor in iterate_weights_with_files(self.resolved):
            self.file = file
            yield name, tensor
        self.exhausted = True

    def source(self) -> Path:
        """The file being read, or the whole checkpoint (folder or GGUF file) once done."""
        if self.file is None or self.exhausted:
            return self.resolved.gguf_file or self.resolved.path
        return self.file
