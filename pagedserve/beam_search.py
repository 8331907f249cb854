"""Beam search, as vLLM's: the ``beam_width`` most likely completions of a prompt.

There is no beam search in the engine core. Each round expands every live beam by one token:
the beam (prompt + its tokens so far) goes to the engine as a request of one greedy token with
the top ``2 x beam_width`` log-probabilities, and of all the one-token extensions the
``beam_width`` best stay live. An extension ending in an EOS token is complete and leaves the
live set. The prefix cache (on by default) holds each beam's full blocks, so a round
recomputes at most the last partial block of each beam. The search ends when no beam is live
or after ``max_tokens`` rounds; the ``beam_width`` best of the complete and live beams are the
result, best first.

A beam's score is its summed log-probability over its length (its tokens, a final EOS not
counted) to the power ``length_penalty``: 1.0 (the default) ranks by the mean log-probability
per token, 0 by the sum (short beams win), above 1 favours long beams. The log-probabilities
are the model's own (raw logits), so a beam search is deterministic.

Pure bookkeeping: ``BeamSearch`` says which token lists to expand and takes their candidates;
``LLM.beam_search`` and the server's ``BeamSearchStream`` run the rounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.field_types import require
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import SamplingParams

DecodeFn = Callable[[list[int]], str]

MAX_BEAM_WIDTH = 10
"""Each expansion asks for 2 x beam_width log-probabilities, at most 20 (``logprobs``' cap)."""


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``. ``max_tokens`` None: up to the context length.
    ``temperature`` must be 0: beams are ranked by the model's log-probabilities."""

    beam_width: int
    max_tokens: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        require(isinstance(self.beam_width, int) and 1 <= self.beam_width <= MAX_BEAM_WIDTH,
                f"beam_width: must be an integer in [1, {MAX_BEAM_WIDTH}], got "
                f"{self.beam_width!r}")
        require(self.max_tokens is None
                or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
                f"max_tokens: must be a positive integer or None, got {self.max_tokens!r}")
        require(self.temperature == 0, "temperature: beam search ranks beams by the model's "
                f"log-probabilities; only 0 is supported, got {self.temperature!r}")
        require(isinstance(self.length_penalty, (int, float))
                and math.isfinite(self.length_penalty),
                f"length_penalty: must be a finite number, got {self.length_penalty!r}")

    @property
    def num_candidates(self) -> int:
        """Candidates taken from each beam's next-token distribution: enough that EOS
        candidates cannot crowd out the ``beam_width`` live ones."""
        return 2 * self.beam_width


def expansion_params(params: BeamSearchParams) -> SamplingParams:
    """One expansion: one greedy token and the most likely next tokens' log-probabilities;
    an EOS is a candidate like any other token (the search decides what it completes)."""
    return SamplingParams(max_tokens=1, temperature=0.0, logprobs=params.num_candidates,
                          ignore_eos=True, detokenize=False)


def expansion_prompt(search: BeamSearch, token_ids: list[int]) -> dict[str, Any]:
    """The prompt of one expansion request: a beam's token ids, with the search's salt."""
    prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
    if search.cache_salt is not None:
        prompt["cache_salt"] = search.cache_salt
    return prompt


def candidates(output: RequestOutput) -> dict[int, float]:
    """An expansion's next-token candidates: token id -> log-probability."""
    logprobs = output.outputs[0].logprobs
    assert logprobs, "expansion requests ask for logprobs"
    return {token: lp.logprob for token, lp in logprobs[0].items()}


@dataclass
class Beam:
    tokens: list[int]
    """Generated token ids (the prompt not included)."""
    cum_logprob: float
    eos_id: int | None = None
    """The EOS token that completed the beam (its last token); None while it may go on."""

    def score(self, length_penalty: float) -> float:
        length = max(1, len(self.tokens) - (self.eos_id is not None))
        return self.cum_logprob / length**length_penalty


@dataclass
class BeamSearch:
    """The beams of one prompt. Call ``pending`` for the token lists to expand, then
    ``advance`` with each one's candidates, until ``pending`` is empty; then ``best``."""

    prompt_token_ids: list[int]
    params: BeamSearchParams
    max_tokens: int
    """Rounds at most: ``params.max_tokens`` or what the context leaves after the prompt."""
    eos_token_ids: frozenset[int]
    """Tokens that complete a beam (the model's EOS ids; empty with ``ignore_eos``)."""
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None
    """These three passed on to every expansion request."""
    live: list[Beam] = field(default_factory=lambda: [Beam([], 0.0)])
    complete: list[Beam] = field(default_factory=list)
    rounds: int = 0

    def pending(self) -> list[list[int]]:
        """Prompt + tokens of every live beam, one request each; empty when the search ends."""
        return [self.prompt_token_ids + beam.tokens for beam in self.live]

    def advance(self, candidates: list[dict[int, float]]) -> None:
        """``candidates[i]``: token id -> log-probability of the next token after live beam
        ``i`` (at least ``params.num_candidates`` of the most likely)."""
        assert len(candidates) == len(self.live), "one candidate dict per live beam"
        extended: list[Beam] = []
        for beam, options in zip(self.live, candidates, strict=True):
            best = sorted(options.items(), key=lambda kv: -kv[1])[: self.params.num_candidates]
            for token, logprob in best:
                child = Beam(beam.tokens + [token], beam.cum_logprob + logprob)
                if token in self.eos_token_ids:
                    child.eos_id = token
                    self.complete.append(child)
                else:
                    extended.append(child)
        self.rounds += 1
        width = self.params.beam_width
        self.live = self._ranked(extended)[:width]
        if self.rounds >= self.max_tokens:
            self.complete.extend(self.live)
            self.live = []
        # A complete beam's score is final: only the best ``width`` can be in the result.
        self.complete = self._ranked(self.complete)[:width]

    def best(self) -> list[Beam]:
        """The ``beam_width`` best beams, complete and live, best first."""
        return self._ranked(self.complete + self.live)[: self.params.beam_width]

    def _ranked(self, beams: list[Beam]) -> list[Beam]:
        penalty = self.params.length_penalty
        return sorted(beams, key=lambda b: -b.score(penalty))


def beam_output(beam: Beam, index: int, primary_eos_id: int | None,
                decode: DecodeFn) -> CompletionOutput:
    """One beam as a completion: finish_reason ``stop`` when an EOS ended it (``stop_reason``
    the token for an EOS other than the model's primary one, as a sampled request reports it),
    ``length`` otherwise; the text leaves the EOS out."""
    text_ids = beam.tokens[:-1] if beam.eos_id is not None else beam.tokens
    return CompletionOutput(
        index=index,
        text=decode(text_ids),
        token_ids=list(beam.tokens),
        cumulative_logprob=beam.cum_logprob,
        logprobs=None,
        finish_reason="length" if beam.eos_id is None else "stop",
        stop_reason=None if beam.eos_id in (None, primary_eos_id) else beam.eos_id,
    )


def text_decoder(tokenizer: Any) -> DecodeFn:
    """Beam tokens to text, special tokens left out; "" without a tokenizer."""
    def decode(token_ids: list[int]) -> str:
        return "" if tokenizer is None else str(
            tokenizer.decode(token_ids, skip_special_tokens=True))
    return decode


def search_output(request_id: str, prompt: str | None, search: BeamSearch,
                  primary_eos_id: int | None, decode: DecodeFn) -> RequestOutput:
    """The finished search as a ``RequestOutput``: one completion per beam, best first."""
    outputs = [beam_output(beam, i, primary_eos_id, decode)
               for i, beam in enumerate(search.best())]
    return RequestOutput(request_id, prompt, list(search.prompt_token_ids), outputs,
                         finished=True)


def search_sequences(search: BeamSearch, primary_eos_id: int | None,
                     decode: DecodeFn) -> BeamSearchOutput:
    """The finished search as vLLM's ``LLM.beam_search`` returns it."""
    completions = search_output("", None, search, primary_eos_id, decode).outputs
    return BeamSearchOutput([
        BeamSearchSequence(search.prompt_token_ids + c.token_ids, c.cumulative_logprob or 0.0,
                           c.text, str(c.finish_reason), c.stop_reason)
        for c in completions
    ])


@dataclass
class BeamSearchSequence:
    """vLLM's: one result of ``LLM.beam_search``. ``tokens`` include the prompt."""

    tokens: list[int]
    cum_logprob: float
    text: str
    finish_reason: str
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """vLLM's: the beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]
