"""Engine logprobs (one ``{token_id: Logprob}`` dict per position, the sampled token first)
in the two OpenAI formats: the legacy completions lists and chat's ``content`` entries."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagedserve.entrypoints.openai.responses import (
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
)
from pagedserve.outputs import Logprob

MIN_LOGPROB = -9999.0
"""JSON has no -inf; a token the model rules out (e.g. through logit_bias) is reported as this."""

Position = dict[int, Logprob] | None


def _value(lp: Logprob) -> float:
    return max(lp.logprob, MIN_LOGPROB)


TokenText = Callable[[int, Logprob | None], str]
"""How a logprob entry names its token: ``decoded_text(tokenizer)`` or ``id_text``."""


def decoded_text(tokenizer: Any) -> TokenText:
    """The token's text (the engine's, else the tokenizer's)."""

    def text(token_id: int, lp: Logprob | None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return tokenizer.decode([token_id])

    return text


def id_text(token_id: int, lp: Logprob | None) -> str:
    """vLLM's ``return_tokens_as_token_ids``: ``"token_id:N"``, which names a token that is
    not a whole character (one byte of a multi-byte one) unambiguously."""
    return f"token_id:{token_id}"


def _kept(token_id: int, position: dict[int, Logprob], top_n: int) -> dict[int, Logprob]:
    """The position's entries a response shows: the token itself and those ranked <= top_n
    (the engine may have computed more, for another field of the same request)."""
    return {tid: lp for tid, lp in position.items()
            if tid == token_id or (lp.rank is not None and lp.rank <= top_n)}


def append_completion_logprobs(
    out: CompletionLogprobs,
    token_ids: list[int],
    positions: Sequence[Position],
    token_text: TokenText,
    text_offset: int,
    top_n: int,
) -> int:
    """Append one entry per token to the legacy lists; returns the text offset after them.

    ``text_offset`` is where the first token's text starts in the choice's text. A position
    of None (the prompt's first token) has no logprob. ``top_n``: the request's ``logprobs``.
    """
    for token_id, position in zip(token_ids, positions, strict=True):
        sampled = None if position is None else position.get(token_id)
        token = token_text(token_id, sampled)
        out.tokens.append(token)
        out.text_offset.append(text_offset)
        text_offset += len(token)
        if position is None or sampled is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_value(sampled))
        out.top_logprobs.append({token_text(tid, lp): _value(lp)
                                 for tid, lp in _kept(token_id, position, top_n).items()})
    return text_offset


def prompt_logprobs(
    token_ids: list[int], positions: Sequence[Position] | None, top_n: int, tokenizer: Any
) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per prompt token, the token and the ``top_n`` most likely
    ones at its position, with their ranks and text."""
    positions = positions or [None] * len(token_ids)
    text = decoded_text(tokenizer)
    return [
        None if position is None else {
            tid: PromptLogprob(logprob=_value(lp), rank=lp.rank,
                               decoded_token=text(tid, lp))
            for tid, lp in _kept(token_id, position, top_n).items()
        }
        for token_id, position in zip(token_ids, positions, strict=True)
    ]


def _top_logprob(token_id: int, lp: Logprob, token_text: TokenText) -> TopLogprob:
    token = token_text(token_id, lp)
    return TopLogprob(token=token, logprob=_value(lp), bytes=list(token.encode("utf-8")))


def chat_logprobs(
    token_ids: list[int], positions: Sequence[Position], top_n: int, token_text: TokenText
) -> list[TokenLogprob]:
    """One chat ``content`` entry per sampled token, with the ``top_n`` most likely tokens.

    The engine ranks the top tokens 1..N and gives the sampled token its true rank, so the
    ``top_n`` alternatives are the entries ranked ``<= top_n``, in rank order.
    """
    entries = []
    for token_id, position in zip(token_ids, positions, strict=True):
        if position is None or token_id not in position:
            continue
        sampled = _top_logprob(token_id, position[token_id], token_text)
        ranked = [
            (lp.rank, tid, lp)
            for tid, lp in position.items()
            if lp.rank is not None and lp.rank <= top_n
        ]
        ranked.sort(key=lambda item: item[0])
        tops = [_top_logprob(tid, lp, token_text) for _, tid, lp in ranked]
        entries.append(TokenLogprob(**sampled.model_dump(), top_logprobs=tops))
    return entries
