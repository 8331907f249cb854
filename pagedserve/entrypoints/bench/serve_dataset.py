"""Random prompts for ``bench serve``, of exact token lengths, built with the server's own
tokenizer (``/tokenize`` and ``/detokenize``, which vLLM serves too): no tokenizer is loaded here.

A prompt is random lowercase "words" tokenized and cut to its length: token ids for the
completions API, or those ids detokenized back to text (whose length the server may count a
little differently; the benchmark reports what the server counted).
"""

from __future__ import annotations

import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from pagedserve.entrypoints.bench.common import random_lengths

PromptKind = Literal["token-ids", "text"]
PROMPT_KINDS = ("token-ids", "text")


@dataclass(frozen=True)
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int
    """Tokens as generated (the server's count of a text prompt may differ slightly)."""
    output_len: int


def _random_text(rng: np.random.Generator, num_words: int) -> str:
    letters = np.array(list(string.ascii_lowercase))
    lengths = rng.integers(2, 9, size=num_words)
    return " ".join("".join(rng.choice(letters, size=int(n))) for n in lengths)


def random_token_ids(
    rng: np.random.Generator, num_tokens: int, tokenize: Callable[[str], list[int]]
) -> list[int]:
    """``num_tokens`` ids of random words (each word is at least one token)."""
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids += tokenize(_random_text(rng, num_tokens - len(ids)))
    return ids[:num_tokens]


def sample_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    prompt_kind: PromptKind,
    seed: int,
    tokenize: Callable[[str], list[int]],
    detokenize: Callable[[list[int]], str],
) -> list[SampleRequest]:
    """``num_prompts`` requests with lengths uniform in ``len * [1 - r, 1 + r]``."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {num_prompts}")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input_len, output_len: must be >= 1, got {input_len}, {output_len}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio: must be in [0, 1), got {range_ratio}")
    if prompt_kind not in PROMPT_KINDS:
        raise ValueError(f"prompt_kind: {prompt_kind!r} is not one of {', '.join(PROMPT_KINDS)}")
    rng = np.random.default_rng(seed)
    input_lens = random_lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = random_lengths(rng, output_len, range_ratio, num_prompts)
    samples = []
    for n_in, n_out in zip(input_lens, output_lens, strict=True):
        ids = random_token_ids(rng, n_in, tokenize)
        prompt = ids if prompt_kind == "token-ids" else detokenize(ids)
        samples.append(SampleRequest(prompt, n_in, n_out))
    return samples
