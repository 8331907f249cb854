"""One host buffer, one copy: the small host-to-device writes of a step, packed together.

Every array the host writes for the device each step (per-slot counts, the batch order,
query_start_loc, the rows to sample, block-table entries) is a typed view into one byte buffer
on the host and has a twin view into one byte buffer on the device. ``copy_to_device`` moves
them all with a single copy. On CUDA the host buffer is pinned, so that copy does not wait
for the device (a copy from pageable memory may), and the device views never move, so CUDA
graphs can read them.

A pinned host buffer must not change while a copy from it is still queued: ``wait_for_copy``
waits for the last copy (an event), and callers call it before they write for the next step.
The last copy is the first work of the previous step on the device, so the wait is normally
over before it starts. On the CPU the copy is a plain memcpy (the same code path, no pinning).

What is not a per-step array (a new request's prefill tokens, its penalty histories, its
logit_bias row) travels once, when the request arrives, through ``host_to_device`` or
``copy_from_host``: a fresh pinned copy, so it does not wait for the device either.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.math_utils import round_up
from pagedserve.platform import platform_for

_ALIGN = 64  # bytes; every array starts at a multiple (any dtype view is aligned)


def _pinned(values: np.ndarray | list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host tensor of ``values``, pinned when it is bound for a CUDA device (a copy from
    pageable memory may wait for the device; the caching host allocator keeps a pinned block
    alive until the copy queued from it has run, so the caller may reuse its data at once)."""
    src = torch.as_tensor(values, dtype=dtype)
    return src.pin_memory() if platform_for(device).pin_memory else src


def host_to_device(
    values: np.ndarray | list, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A new device tensor holding ``values``, copied without waiting for the device. On the
    CPU it may share memory with a numpy ``values`` of the same dtype."""
    return _pinned(values, dtype, device).to(device, non_blocking=True)


def copy_from_host(dst: torch.Tensor, values: np.ndarray | list) -> None:
    """``dst[:] = values`` for a device tensor, queued without waiting for the device."""
    dst.copy_(_pinned(values, dst.dtype, dst.device), non_blocking=True)


@dataclass(frozen=True)
class StagedArray:
    """One array of the buffer: ``numel`` elements of ``dtype``."""

    name: str
    dtype: torch.dtype
    numel: int


class StagingBuffer:
    """Named arrays packed in one byte buffer: ``host[name]`` (numpy) and
    ``device_views[name]`` (torch, on the device)."""

    def __init__(self, arrays: list[StagedArray], device: torch.device) -> None:
        names = [a.name for a in arrays]
        if len(set(names)) != len(names):
            raise ValueError(f"arrays: names must be unique, got {names}")
        self.device = device
        spans: dict[str, tuple[int, int]] = {}  # name -> (first byte, end byte)
        offset = 0
        for a in arrays:
            end = offset + a.numel * a.dtype.itemsize
            spans[a.name] = (offset, end)
            offset = round_up(end, _ALIGN)
        self.nbytes = max(offset, _ALIGN)
        platform = platform_for(device)
        self.host_bytes = torch.zeros(self.nbytes, dtype=torch.uint8,
                                      pin_memory=platform.pin_memory)
        self.device_bytes = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        self.host: dict[str, np.ndarray] = {}
        self.device_views: dict[str, torch.Tensor] = {}
        for a in arrays:
            start, end = spans[a.name]
            self.host[a.name] = self.host_bytes[start:end].view(a.dtype).numpy()
            self.device_views[a.name] = self.device_bytes[start:end].view(a.dtype)
        self._copied = platform.new_event()  # None where copies are synchronous
        self._copy_pending = False

    def wait_for_copy(self) -> None:
        """Return once the device has read the host buffer of the last copy (call before
        writing for the next step). Immediate on the CPU."""
        if self._copied is not None and self._copy_pending:
            self._copied.synchronize()
            self._copy_pending = False

    def copy_to_device(self) -> None:
        """One copy of the whole host buffer into the device buffer, queued on the current
        stream (a few kilobytes: copying what a step left unchanged costs less than choosing)."""
        self.device_bytes.copy_(self.host_bytes, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
            self._copy_pending = True
