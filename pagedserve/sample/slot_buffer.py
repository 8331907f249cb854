"""Per-slot parameters written on the host and read on the device.

``add_request`` writes the numpy mirror; the sampler copies every dirty mirror to the device once,
at the start of a step ("staged writes"), so setting parameters launches no device work and a
step never reads a half-written buffer. Host-side code reads the mirror (indexed with
``idx_mapping_np``) to decide which ops a batch needs, without asking the device.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.platform import platform_for


def host_to_device(
    values: np.ndarray | list, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Copy host data to the device without waiting for the device's queued work.

    A plain (pageable) copy waits for the stream to drain. A fresh pinned copy with
    non_blocking=True does not, and the caching host allocator keeps that pinned block alive
    until the copy has run, so the caller may overwrite its own data right away.
    """
    src = torch.as_tensor(np.asarray(values), dtype=dtype)
    if platform_for(device).pin_memory:
        src = src.pin_memory()
    return src.to(device, non_blocking=True)


class SlotBuffer:
    """One value (or one fixed-width row) per slot: ``np`` on the host, ``dev`` on the device."""

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        fill: float | int,
    ) -> None:
        self.dev = torch.full(shape, fill, dtype=dtype, device=device)  # [max_num_reqs, ...]
        self.np = torch.full(shape, fill, dtype=dtype).numpy()  # same shape, host mirror
        self.dirty = False

    def __setitem__(self, index: object, value: object) -> None:
        self.np[index] = value
        self.dirty = True

    def copy_to_device(self) -> None:
        if self.dirty:
            self.dev.copy_(host_to_device(self.np, self.dev.dtype, self.dev.device))
            self.dirty = False


class SlotTokenTable:
    """Per slot, a short list of (token id, value) pairs, padded to a common width.

    Used for ``logit_bias`` (value = bias) and the ``min_tokens`` stop ids (value = -inf).
    Padding entries are (token 0, value 0.0), so ``scatter_add_`` of a gathered row adds nothing
    through them. The width grows (to the next power of two) when a request brings more pairs;
    only add_request does that, never a step.
    """

    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.device = device
        self.width = 0
        self.token_ids = self._buffer(0, torch.int64)  # int64 [max_num_reqs, width]
        self.values = self._buffer(0, torch.float32)  # fp32 [max_num_reqs, width]
        self.num_entries = np.zeros(max_num_reqs, dtype=np.int64)  # [max_num_reqs]

    def _buffer(self, width: int, dtype: torch.dtype) -> SlotBuffer:
        return SlotBuffer((self.max_num_reqs, width), dtype, self.device, 0)

    def _grow(self, width: int) -> None:
        new_width = 1 << (width - 1).bit_length()
        token_ids = self._buffer(new_width, torch.int64)
        values = self._buffer(new_width, torch.float32)
        token_ids[:, : self.width] = self.token_ids.np
        values[:, : self.width] = self.values.np
        self.token_ids, self.values, self.width = token_ids, values, new_width

    def set_row(self, slot: int, token_ids: list[int], values: list[float]) -> None:
        if len(token_ids) > self.width:
            self._grow(len(token_ids))
        n = len(token_ids)
        self.token_ids[slot] = 0
        self.values[slot] = 0.0
        self.token_ids[slot, :n] = token_ids
        self.values[slot, :n] = values
        self.num_entries[slot] = n

    def clear_row(self, slot: int) -> None:
        self.set_row(slot, [], [])

    def any_entries(self, idx_mapping_np: np.ndarray) -> bool:
        return bool(np.any(self.num_entries[idx_mapping_np] > 0))

    def copy_to_device(self) -> None:
        self.token_ids.copy_to_device()
        self.values.copy_to_device()
