"""Ctrl-C during offline generation: a SIGINT that arrives inside an engine step is held until
the step returns, so the scheduler, the model runner and the output processor never see half
a step; one that arrives between steps is handled at once, as usual."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

_Handler = Callable[[int, FrameType | None], Any]


class DeferredInterrupt:
    """Context manager around a generation loop; ``step()`` wraps each engine step.

    The handler installed before (Python's ``KeyboardInterrupt``, or the application's own)
    is the one finally called. Outside the main thread, or when SIGINT is ignored or left to
    the OS, nothing is installed and ``step()`` defers nothing.
    """

    def __init__(self) -> None:
        self._previous: _Handler | None = None
        self._in_step = False
        self._pending: FrameType | None | bool = False

    def __enter__(self) -> DeferredInterrupt:
        if threading.current_thread() is not threading.main_thread():
            return self
        previous = signal.getsignal(signal.SIGINT)
        if callable(previous):
            self._previous = previous
            signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._in_step:
            self._pending = True
        elif self._previous is not None:
            self._previous(signum, frame)

    @contextmanager
    def step(self) -> Iterator[None]:
        """Run one engine step; a SIGINT held during it is delivered when it returns."""
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False
        if self._pending and self._previous is not None:
            self._pending = False
            self._previous(signal.SIGINT, None)
