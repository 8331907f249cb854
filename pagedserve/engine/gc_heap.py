"""Keep the start-up heap out of Python's garbage collector.

Importing torch, transformers and the compile stack, loading the model, compiling it and
capturing its graphs create about a million objects that live as long as the process and almost
no cyclic garbage. Left in the collector's generations, they are walked again by every full
(generation-2) collection, in time proportional to their number, so one collection that lands
in the middle of serving stalls a step while the GPU waits (docs/gpu.md#host-side-stalls). A
burst of requests triggers such collections (their objects survive the young generations and
the collector's long-lived threshold trips). ``gc.freeze()`` moves everything alive at that
moment into a permanent generation that no collection visits; vLLM's engine core does the same
after start-up.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from contextlib import contextmanager


def freeze_startup_heap(owner: object) -> None:
    """Collect once, then freeze what is left: the engine's whole start-up heap, until
    ``owner`` (the engine) is gone.

    The collection first, so that no start-up garbage (compile-time graphs, warm-up tensors in
    reference cycles: host memory, and card memory where a cycle holds a tensor) is frozen for
    the life of the process; it walks the heap once. A frozen object is
    still freed when its last reference goes, but a frozen reference cycle never is: when the
    engine is dropped (a notebook or a test building a new one), everything is unfrozen, so
    that the next collection can free whatever cycles the old engine left, card memory
    included. (Another engine alive in the same process is then walked again until it is
    frozen anew: one engine per process is the case this serves.)
    """
    gc.collect()
    gc.freeze()
    weakref.finalize(owner, gc.unfreeze)


@contextmanager
def startup_gc_paused() -> Iterator[None]:
    """Run a start-up with the cyclic collector paused, then freeze what it built.

    Each collection triggered during start-up would walk the whole growing heap again, for the
    few thousand objects of cyclic garbage it finds (docs/cpu.md#start-up-on-the-host); the
    few start-up cycles the freeze keeps are the price. Nests: an inner pause leaves the
    collector as the outer one wants it (off) until the outer one ends.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
