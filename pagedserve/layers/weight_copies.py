"""Weights copied into another layout for a faster CPU product (oneDNN's blocked layout, the
panels of ``panel_gemm.h``), made on a weight's first use (the panels: at the engine's start-up,
``CpuPlatform.prepare_weights``) and kept per weight tensor within the packed-copy budget
(``cpu_pack_budget.py``). An in-place write to the weight (a reload) bumps
its version counter, and the copy is made again."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from pagedserve.layers.cpu_pack_budget import PackBudget, pack_budget


class WeightCopies:
    """``make(weight)`` per weight tensor, kept while the weight lives and is unchanged."""

    def __init__(self, make: Callable[[torch.Tensor], torch.Tensor], what: str,
                 budget: PackBudget | None = None, copy_dtype: torch.dtype | None = None) -> None:
        self.make = make
        self.what = what
        """Names the copies in the budget's warning."""
        self.copy_dtype = copy_dtype
        """The copies' element type where ``make`` changes it (None: the weight's), for the
        bytes each counts in the budget."""
        self.budget = budget or pack_budget()
        # id(weight) -> (weakref to it, its version when copied, the copy, the bytes it counts
        # for in the budget)
        self._copies: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor, int]] = {}

    def __len__(self) -> int:
        return len(self._copies)

    def has(self, weight: torch.Tensor) -> bool:
        """Whether the weight's copy exists and is current (``get`` would not make one)."""
        return self._current(weight) is not None

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The weight's copy, made now if it has none or the weight changed since; None while
        the budget has no room for it."""
        current = self._current(weight)
        if current is not None:
            return current
        key = id(weight)
        self._forget(key)
        dtype = self.copy_dtype or weight.dtype
        nbytes = weight.numel() * dtype.itemsize
        if not self.budget.take(nbytes, f"a [{weight.shape[0]}, {weight.shape[1]}] {self.what}"):
            return None
        copy = self.make(weight.detach())
        self._copies[key] = (weakref.ref(weight, lambda _: self._forget(key)),
                             weight._version, copy, nbytes)
        return copy

    def _current(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The weight's copy if it was made from this tensor at its present version."""
        entry = self._copies.get(id(weight))
        if entry is not None and entry[0]() is weight and entry[1] == weight._version:
            return entry[2]
        return None

    def _forget(self, key: int) -> None:
        entry = self._copies.pop(key, None)
        if entry is not None:
            self.budget.give_back(entry[3])
