"""Non-owning tensor views, so captured graph outputs do not pin their memory.

A CUDA graph's outputs live in the graph memory pool. Holding them strongly for every capture
size would keep every size's activations alive at once; holding a non-owning view lets the
next capture (of a smaller size, in the same pool) reuse the memory. Replays of different sizes
never overlap, so the aliasing is safe (vLLM relies on the same fact).
"""

from __future__ import annotations

from typing import Any

import torch


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
