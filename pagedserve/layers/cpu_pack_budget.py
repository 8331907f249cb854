"""How much memory the CPU's packed weight copies may take.

The CPU's fast products read weights in layouts of their own (oneDNN's blocked layout for many
rows, the C decode step's panels), each a copy held beside the plain weight, which the small
products and the torch reference still read. For the default model that is a few hundred MB;
for an 8B model each copy is another 16 GB. So copies are made only while they fit in a share
of the memory available when the first one is made; a weight whose copy does not fit keeps
the plain layout (slower products, never a swap or an out-of-memory kill), logged once.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from pagedserve.cpu_memory import available_host_bytes

logger = logging.getLogger(__name__)

PACK_SHARE_OF_AVAILABLE = 0.25
"""Packed copies take at most this share of the memory available at the first one. Low,
because the CPU KV cache's pages (up to half of what was available at start-up) are
allocated but only become resident as they are written, after the copies are made."""


class PackBudget:
    """Bytes left for packed copies; ``take`` before making one, ``give_back`` when it is
    freed."""

    def __init__(self, available: Callable[[], int] = available_host_bytes,
                 share: float = PACK_SHARE_OF_AVAILABLE) -> None:
        self._available = available
        self._share = share
        self._left: int | None = None
        self._refused = False

    def take(self, nbytes: int, what: str) -> bool:
        """Whether a copy of ``nbytes`` may be made (then counted), ``what`` names it in the
        one warning when it may not."""
        if self._left is None:
            self._left = int(self._available() * self._share)
        if nbytes > self._left:
            if not self._refused:
                logger.warning(
                    "CPU: %s keeps its plain weights (slower products): its packed copy "
                    "(%.2f GiB) is over what is left of %.0f%% of the memory available for "
                    "packed weights (%.2f GiB)", what, nbytes / 2**30, self._share * 100,
                    self._left / 2**30)
            self._refused = True
            return False
        self._left -= nbytes
        return True

    def give_back(self, nbytes: int) -> None:
        if self._left is not None:
            self._left += nbytes


@functools.cache
def pack_budget() -> PackBudget:
    """The process's budget: host memory is one pool for every packed copy."""
    return PackBudget()
