"""SamplingParams: how one request is sampled and when it stops (vLLM's names and defaults)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from pagedserve.field_types import check_field_types, holds, require, shown, token_id_list
from pagedserve.structured_output.params import StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams"]

_MAX_N = 128
_MAX_LOGPROBS = 20
_MAX_STOP_STRINGS = 64
MAX_ALLOWED_TOKEN_IDS = 2048
"""Per request: each slot's row of the sampler's allowed-id table is as wide as the longest
list in use, so the cap bounds that table's memory (a few MiB at hundreds of slots)."""
MAX_BAD_WORDS = 64
"""Per request, words in ``bad_words``; each becomes one or two token sequences."""
MAX_BAD_WORDS_TOKEN_IDS = 128
"""Per request, sequences given directly in ``bad_words_token_ids``. With the two variants of
each of ``MAX_BAD_WORDS`` words, a slot's row of the sampler's bad-words table holds at most
256 sequences."""
MAX_BAD_WORD_TOKENS = 16
"""Tokens in one bad-word sequence: the sampler's per-slot tables and its history of recent
output tokens are as wide as the longest sequence in use, so the cap keeps them small."""


def _token_biases(logit_bias: Any) -> dict[int, float]:
    """``logit_bias`` as {token id: bias}; token ids may come as strings (JSON keys)."""
    require(isinstance(logit_bias, dict),
            f"logit_bias: expected a dict of token id -> bias, got {logit_bias!r}")
    out = {}
    for key, bias in logit_bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias: {key!r} is not a token id") from None
        require(holds(bias, float), f"logit_bias: the bias for token {key!r} is not a number")
        out[token] = float(bias)
    return out


def _bad_words(words: Any) -> list[str]:
    """``bad_words`` as a list of words, each with a character other than whitespace (the
    tokenization strips leading whitespace, as vLLM's does, and an empty word has no tokens)."""
    if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
        raise ValueError(f"bad_words: expected a list of strings, got {shown(words)}")
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words: at most {MAX_BAD_WORDS} words, got {len(words)}")
    if not all(w.strip() for w in words):
        raise ValueError("bad_words: every word must be a non-empty string with a character "
                         "other than whitespace")
    return list(words)


def _bad_words_token_ids(sequences: Any) -> list[list[int]]:
    """``bad_words_token_ids`` as lists of ints, each non-empty and at most
    ``MAX_BAD_WORD_TOKENS`` long."""
    field = "bad_words_token_ids"
    if not isinstance(sequences, (list, tuple)):
        raise ValueError(f"{field}: expected a list of token id lists, got {shown(sequences)}")
    if len(sequences) > MAX_BAD_WORDS_TOKEN_IDS:
        raise ValueError(
            f"{field}: at most {MAX_BAD_WORDS_TOKEN_IDS} sequences, got {len(sequences)}"
        )
    out = [token_id_list(field, ids) for ids in sequences]
    for ids in out:
        if not 0 < len(ids) <= MAX_BAD_WORD_TOKENS:
            raise ValueError(f"{field}: each sequence must have 1 to {MAX_BAD_WORD_TOKENS} "
                             f"token ids, got {len(ids)}")
    return out


MAX_TEMPERATURE = 100.0
"""Far past where sampling is uniform noise; a larger one (1e308) overflows the logits to
infinity in float32 and turns masked ones into NaN."""

@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1: no top-k."""
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    """Sample only among these token ids (at most 2048; every other logit is -inf before any
    sampling step, greedy included); None: every token. Logprobs stay the model's."""
    bad_words: list[str] | None = None
    """Words that are never generated (vLLM's): the last token of a word's tokens is blocked
    whenever the output so far ends with the ones before it (at most 64 words). Each word is
    tokenized as it is and after a space; the engine fills ``bad_words_token_ids`` from them."""
    bad_words_token_ids: list[list[int]] | None = None
    """The token sequences the sampler blocks; filled by the engine from ``bad_words`` (or
    given directly: each a non-empty list of at most 16 ids, at most 128 lists)."""
    max_tokens: int | None = 16
    """None: up to the context length."""
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    """Number of top logprobs to return per sampled token (the sampled one is always added)."""
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    """Keep only the prompt's last k tokens (left truncation; -1: the last max_model_len);
    None: the whole prompt (too long a prompt is refused)."""
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (a dict of its fields
    is accepted too)."""

    def __post_init__(self) -> None:
        check_field_types(self)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        require(self.structured_outputs is None
                or isinstance(self.structured_outputs, StructuredOutputsParams),
                "structured_outputs: expected StructuredOutputsParams or None, got "
                f"{type(self.structured_outputs).__name__}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        require(self.stop is None or isinstance(self.stop, list | tuple),
                f"stop: expected a string or a list of strings, got {self.stop!r}")
        self.stop = list(self.stop or [])
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        self.stop_token_ids = token_id_list("stop_token_ids", ids)
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = _token_biases(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = token_id_list("allowed_token_ids", self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = _bad_words(self.bad_words)
        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = _bad_words_token_ids(self.bad_words_token_ids)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field that is out of range."""
        checks = [
            (1 <= self.n <= _MAX_N, f"n must be in [1, {_MAX_N}], got {self.n}"),
            (0.0 <= self.temperature <= MAX_TEMPERATURE,
             f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1 (off) or >= 1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (0.0 < self.repetition_penalty <= 2.0, f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= _MAX_LOGPROBS,
                f"logprobs must be in [0, {_MAX_LOGPROBS}], got {self.logprobs}",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= _MAX_LOGPROBS,
                f"prompt_logprobs must be in [0, {_MAX_LOGPROBS}], got {self.prompt_logprobs}",
            ),
            (len(self.stop) <= _MAX_STOP_STRINGS, f"stop: at most {_MAX_STOP_STRINGS} strings, got {len(self.stop)}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop: every stop string must be a non-empty string"),
            (self.seed is None or 0 <= self.seed < 2**63, f"seed must be in [0, 2**63), got {self.seed}"),
            (
                self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
                "allowed_token_ids: an empty list allows no token (None: every token)",
            ),
            (
                self.allowed_token_ids is None
                or len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS,
                f"allowed_token_ids: at most {MAX_ALLOWED_TOKEN_IDS} ids, got "
                f"{len(self.allowed_token_ids or ())} (logit_bias -100 takes a few tokens out)",
            ),
            (
                self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1
                or self.truncate_prompt_tokens == -1,
                f"truncate_prompt_tokens must be -1 (max_model_len) or >= 1, got "
                f"{self.truncate_prompt_tokens}",
            ),
            (
                self.structured_outputs is None or self.min_tokens == 0,
                "min_tokens: not supported with structured_outputs (the grammar decides where "
                "the answer ends)",
            ),
        ]
        for ok, msg in checks:
            require(ok, msg)
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                if not -100.0 <= bias <= 100.0:
                    raise ValueError(f"logit_bias: bias for token {tok} must be in [-100, 100], got {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self) -> SamplingParams:
        """A copy with its own lists and dict (every other field is immutable): cheaper than a
        deep copy, which admission would pay per request."""
        twin = copy.copy(self)
        twin.stop = list(self.stop)
        twin.stop_token_ids = list(self.stop_token_ids)
        twin.logit_bias = None if self.logit_bias is None else dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            twin.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            twin.bad_words = list(self.bad_words)
        if self.bad_words_token_ids is not None:
            twin.bad_words_token_ids = [list(ids) for ids in self.bad_words_token_ids]
        return twin
