"""Prefixes of a fixed-address buffer, made once per length and reused.

A step uses the first n entries of each persistent buffer. Slicing a tensor costs about a
microsecond of host time, and a run of decodes asks for the same lengths step after step, so
each buffer keeps the views it has handed out (the buffer never moves, so neither do they).
"""

from __future__ import annotations

import torch

_MAX_CACHED = 64
"""Distinct lengths kept per buffer; past that the cache starts over (prefill chunks vary)."""


class PrefixViews:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self._views: dict[int, torch.Tensor] = {}

    def __getitem__(self, n: int) -> torch.Tensor:
        """``tensor[:n]``."""
        view = self._views.get(n)
        if view is None:
            if len(self._views) >= _MAX_CACHED:
                self._views.clear()
            view = self._views[n] = self.tensor[:n]
        return view
