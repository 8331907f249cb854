"""Token ids -> text, a few tokens at a time, with stop strings found across token boundaries.

Decoding one token alone is wrong in two ways: byte-level BPE splits a multi-byte character over
several tokens (each decodes to U+FFFD), and SentencePiece decides a token's leading space from
its neighbours. So, like vLLM's ``IncrementalDetokenizer``, we decode a small window twice: the
already-emitted tokens ``[prefix_offset, read_offset)`` and the window plus the new tokens
``[prefix_offset, end)``; the new text is the difference, emitted only once it no longer ends in
an incomplete character.
"""

from __future__ import annotations

from typing import Any

from pagedserve.core.sched_output import LogprobsLists
from pagedserve.outputs import Logprob
from pagedserve.sampling_params import SamplingParams

PROMPT_CONTEXT_TOKENS = 5
"""Prompt tokens decoded in front of the first generated one (its leading space depends on them)."""

REPLACEMENT_CHAR = "\ufffd"


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """Find the earliest stop string that overlaps the last ``new_char_count`` characters.

    Returns (stop string, length to truncate the text to), or None. Only the tail that can hold
    a match touching the new characters is searched, so the cost does not grow with the text.
    """
    if new_char_count <= 0:
        return None
    best: tuple[int, str] | None = None
    for stop_str in stop:
        start = max(len(output_text) - new_char_count - len(stop_str) + 1, 0)
        index = output_text.find(stop_str, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop_str)
    if best is None:
        return None
    index, stop_str = best
    return stop_str, index + len(stop_str) if include_in_output else index


class IncrementalDetokenizer:
    """One completion's text. Invariant: ``output_text`` is the decode of every output token fed
    so far except a trailing incomplete character, cut at a stop string once one is found."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # Held back from streaming while unfinished: a stop string may still start in it.
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1
            if self.stop and not self.include_stop_str_in_output
            else 0
        )
        # Prompt tail (context for the first token's spacing) followed by the output tokens.
        self.token_ids: list[int] = list(prompt_token_ids[-(PROMPT_CONTEXT_TOKENS + 1) :])
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(self.read_offset - PROMPT_CONTEXT_TOKENS, 0)
        self.num_output_tokens = 0
        self.output_text = ""
        self._last_output_text_offset = 0

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _decode_next(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet, or an incomplete character: wait for more tokens
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Feed new tokens; return the stop string that ends the completion, if one appeared.

        ``stop_terminated``: the engine core stopped on the last token (EOS or a stop token id);
        that token is kept out of the text unless ``include_stop_str_in_output``. Stop strings
        are looked for only in text from tokens beyond ``min_tokens``.
        """
        skipped = 0
        if stop_terminated and not self.include_stop_str_in_output:
            new_token_ids, skipped = new_token_ids[:-1], 1
        stop_check_offset = len(self.output_text)
        for token_id in new_token_ids:
            self.output_text += self._decode_next(token_id)
            self.num_output_tokens += 1
            if self.num_output_tokens <= self.min_tokens:
                stop_check_offset = len(self.output_text)
        self.num_output_tokens += skipped
        if not self.stop or self.num_output_tokens <= self.min_tokens:
            return None
        found = check_stop_strings(
            self.output_text,
            len(self.output_text) - stop_check_offset,
            self.stop,
            self.include_stop_str_in_output,
        )
        if found is None:
            return None
        stop_str, truncate_to = found
        self.output_text = self.output_text[:truncate_to]
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to report now: all of it, or (``delta``) what was not reported before.

        While unfinished, the last ``stop_buffer_length`` characters are held back: they may
        turn out to be the start of a stop string that must not be shown.
        """
        length = len(self.output_text) - (0 if finished else self.stop_buffer_length)
        if not delta:
            return self.output_text[: max(length, 0)]
        start = self._last_output_text_offset
        if length <= start:
            return ""
        self._last_output_text_offset = length
        return self.output_text[start:length]


def decode_logprobs(tokenizer: Any, rows: LogprobsLists) -> list[dict[int, Logprob]]:
    """Runner rows (sampled token first, then the top-N) -> one dict per position.

    The sampled token comes first in each dict; when it is also in the top-N it appears once.
    ``tokenizer`` None (``detokenize=False``) leaves ``decoded_token`` empty.
    """
    positions: list[dict[int, Logprob]] = []
    for token_ids, logprobs, rank in zip(rows.token_ids, rows.logprobs, rows.ranks, strict=True):
        entry: dict[int, Logprob] = {}
        for j, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
            if token_id in entry:
                continue
            decoded = None if tokenizer is None else tokenizer.decode([token_id])
            entry[token_id] = Logprob(logprob, rank if j == 0 else j, decoded)
        positions.append(entry)
    return positions
