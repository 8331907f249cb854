"""Reasoning parsers (``--reasoning-parser``): a model's thinking, ``<think>...</think>``, apart
from its answer. ``split`` reads a finished output, ``split_partial`` an unfinished one (its
results only grow as the text grows, as the tool parsers' do); both return
(reasoning or None, the rest), and the rest is what the tool parser reads."""

from __future__ import annotations

from abc import ABC, abstractmethod

from pagedserve.entrypoints.openai.tool_parsers.base import held_back

THINK_START = "<think>"
THINK_END = "</think>"


def _after_start(text: str) -> int | None:
    """Where the thinking starts when the output opens with ``<think>`` (after whitespace);
    None when it does not."""
    stripped = text.lstrip()
    if not stripped.startswith(THINK_START):
        return None
    return len(text) - len(stripped) + len(THINK_START)


def _split_thinking(body: str) -> tuple[str, str]:
    """(thinking, answer) of text that starts inside the thinking."""
    end = body.find(THINK_END)
    if end < 0:
        return body, ""
    return body[:end], body[end + len(THINK_END) :].lstrip()


def _split_thinking_partial(body: str) -> tuple[str, str]:
    end = body.find(THINK_END)
    if end < 0:
        return body[: len(body) - held_back(body, THINK_END)], ""
    return body[:end], body[end + len(THINK_END) :].lstrip()


class ReasoningParser(ABC):
    @abstractmethod
    def split(self, text: str) -> tuple[str | None, str]: ...

    @abstractmethod
    def split_partial(self, text: str) -> tuple[str | None, str]: ...


class Qwen3ReasoningParser(ReasoningParser):
    """``qwen3``: thinking is what follows a ``<think>`` the output opens with, up to
    ``</think>`` (or the end, when cut off); without it (``enable_thinking: false`` puts an
    empty one in the prompt) the whole output is the answer."""

    def split(self, text: str) -> tuple[str | None, str]:
        start = _after_start(text)
        return (None, text) if start is None else _split_thinking(text[start:])

    def split_partial(self, text: str) -> tuple[str | None, str]:
        start = _after_start(text)
        if start is not None:
            return _split_thinking_partial(text[start:])
        if THINK_START.startswith(text.lstrip()):
            return "", ""  # may still open with <think>
        return None, text


class DeepSeekR1ReasoningParser(ReasoningParser):
    """``deepseek_r1``: the output is thinking up to ``</think>`` (its chat template writes the
    ``<think>`` into the prompt; one the model writes itself is dropped)."""

    def split(self, text: str) -> tuple[str | None, str]:
        start = _after_start(text)
        return _split_thinking(text[start or 0 :])

    def split_partial(self, text: str) -> tuple[str | None, str]:
        start = _after_start(text)
        if start is None and THINK_START.startswith(text.lstrip()):
            return "", ""
        return _split_thinking_partial(text[start or 0 :])


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
}
