"""Which engine steps made the host wait for the device, and why (``busy_timeline.py --device-waits``).

Two ways a step's host code can stall on the GPU without asking to: a ``cudaMalloc`` (the
caching allocator found no cached block; the driver call synchronizes the device), and a
synchronizing CUDA call (a device-to-host copy, ``.item()``, ``nonzero``...). Per engine step
this log counts the first (the allocator's ``num_device_alloc`` counter before and after the
step) and records the second with torch's sync debug mode (``warn``), keeping the frames of
``pagedserve`` code that made the call. ``memory_stats`` costs ~0.1 ms per call, so a run with
this log is for finding waits, not for the busy figure.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from step_wrap import wrap_step

import pagedserve

FRAMES_KEPT = 4
PACKAGE = str(Path(pagedserve.__file__).resolve().parent)


class DeviceWaitLog:
    """Wraps ``EngineCore.step`` while installed; ``steps`` is the list whose length is the
    current step's index (``busy_timeline.StepLog.steps``)."""

    def __init__(self, core, steps: list) -> None:  # noqa: ANN001
        self.events: list[dict] = []
        self._steps = steps
        self._unwrap = wrap_step(core, self._watched)
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        self._show_other = warnings.showwarning
        warnings.showwarning = self._on_warning
        torch.cuda.set_sync_debug_mode("warn")

    def _watched(self, step: Callable[[], object]) -> object:
        before = torch.cuda.memory_stats().get("num_device_alloc", 0)
        out = step()
        allocs = torch.cuda.memory_stats().get("num_device_alloc", 0) - before
        if allocs:
            self.events.append({"step": len(self._steps) - 1, "kind": "cudaMalloc",
                                "count": allocs})  # fmt: skip
        return out

    def _on_warning(self, message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001, PLR0913
        if "synchroniz" not in str(message):
            self._show_other(message, category, filename, lineno, file, line)
            return
        frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}"
                  for f in traceback.extract_stack() if f.filename.startswith(PACKAGE)]
        self.events.append({"step": len(self._steps), "kind": "sync",
                            "frames": frames[-FRAMES_KEPT:]})  # fmt: skip

    def remove(self) -> dict:
        """Uninstall; the events (first 60) and their count per kind."""
        torch.cuda.set_sync_debug_mode("default")
        self._warnings.__exit__(None, None, None)
        self._unwrap()
        counts: dict[str, int] = {}
        for e in self.events:
            counts[e["kind"]] = counts.get(e["kind"], 0) + 1
        return {"counts": counts, "events": self.events[:60]}
