"""The forward context: per-step data that layers look up by name during one forward pass.

The model's forward signature stays ``(input_ids, positions)``; the runner installs the
attention metadata and slot mappings here around the call, and each attention layer finds its
own entry by its layer name (``model.layers.{i}.self_attn.attn``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from pagedserve.attention.backends.base import AttentionMetadata


@dataclass
class ForwardContext:
    attn_metadata: dict[str, AttentionMetadata]
    """layer name -> metadata (one object shared by every layer of a KV-cache group)."""
    slot_mapping: dict[str, torch.Tensor]
    """layer name -> int64 [num_tokens_padded] cache slots."""
    num_tokens: int
    """Padded token count of this forward."""
    cudagraph_mode: str = "NONE"
    """NONE | PIECEWISE | FULL (set by the runner's dispatcher); graph wrappers read it."""
    query_len: int = 1
    """Tokens per request of a FULL forward: 1 + k when each request verifies k drafts (those
    graphs are kept apart from the one-token ones)."""
    attn_layers: dict[str, torch.nn.Module] = field(default_factory=dict)
    """layer name -> attention layer: the registered attention op finds its layer here, since
    a custom op takes tensors and strings, not modules."""


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context: the model must be called inside set_forward_context")
    return _current


@contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous
