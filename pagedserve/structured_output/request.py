"""One request's grammar state in the engine core: its (future) compiled grammar and, once
that is ready, its matcher, which follows the request's output tokens one by one."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any


class StructuredOutputRequest:
    """The matcher holds exactly the request's output tokens: the scheduler advances it for
    every token it appends, and nothing else moves it. Preemption keeps a request's output
    tokens (they are recomputed, not dropped), so the matcher needs no rollback there."""

    def __init__(self, compiled: Future[Any]) -> None:
        self.compiled = compiled
        self._matcher: Any = None

    def is_ready(self) -> bool:
        """Whether the grammar finished compiling (or failed: see ``error``)."""
        return self.compiled.done()

    def error(self) -> str | None:
        """Why the grammar could not be compiled, once ``is_ready``; None when it compiled."""
        exc = self.compiled.exception()
        return None if exc is None else f"{type(exc).__name__}: {exc}"

    @property
    def matcher(self) -> Any:
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self.compiled.result())
        return self._matcher

    def accept_token(self, token_id: int) -> bool:
        """Advance past ``token_id``; False if the grammar does not allow it."""
        return bool(self.matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return bool(self.matcher.is_terminated())
