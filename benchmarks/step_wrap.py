"""Run code around every ``EngineCore.step`` of a live engine, and take it away again."""

from __future__ import annotations

from collections.abc import Callable


def wrap_step(core, around: Callable[[Callable[[], object]], object]) -> Callable[[], None]:  # noqa: ANN001
    """Make ``core.step()`` call ``around(step)`` with the step it had; returns the function
    that puts that step back (a no-op once another wrapper has wrapped this one: it then stays
    in the chain, and ``around`` should pass through when its work is done)."""
    inner = core.step

    def wrapped() -> object:
        return around(inner)

    def unwrap() -> None:
        if core.step is wrapped:
            core.step = inner

    core.step = wrapped
    return unwrap
