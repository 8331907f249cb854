"""The proposer interface: draft token ids for some requests, from what the host knows.

A proposer sees each drafting request's token ids (prompt and output, all known on the host:
the scheduler proposes only for requests with no step in flight) and the most drafts it may
return. The ngram proposer looks them up in the same ids; a draft model or an EAGLE head would
run on the device through the executor behind the same call.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pagedserve.config import SpeculativeConfig


@dataclass
class DraftRequest:
    """One request that may draft this step."""

    req_id: str
    token_ids: list[int]
    """Prompt then output ids; the last one is the token the step runs first."""
    max_drafts: int
    """At most this many drafts (>= 1): bounded by k, max_tokens and max_model_len."""


class Proposer(Protocol):
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Drafts per request, in order: at most ``max_drafts`` each, possibly none."""
        ...

    def finish(self, req_ids: Iterable[str]) -> None:
        """These requests are gone: drop what is kept for them."""
        ...


class StatelessProposer:
    """A proposer that keeps nothing per request (its ``finish`` has nothing to drop)."""

    def finish(self, req_ids: Iterable[str]) -> None:
        del req_ids


def make_proposer(config: SpeculativeConfig) -> Proposer | None:
    """The proposer of ``config.method`` where it needs no device; None for ``draft_model``,
    which the engine core builds beside the target's runner (``draft_model.py``)."""
    from pagedserve.spec_decode.ngram import NgramProposer  # numpy only

    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    return None
