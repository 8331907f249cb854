"""Two engines' greedy outputs agree (tests only): tokens equal, or where they first differ
each side's token is among the other's top 5 (``logprobs=5``)."""

from __future__ import annotations

from pagedserve.outputs import CompletionOutput


def assert_agree_where_they_part(a: list[CompletionOutput], b: list[CompletionOutput]) -> None:
    for x, y in zip(a, b, strict=True):
        first = next((i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids, strict=True))
                      if s != t), None)
        if first is not None:
            assert x.logprobs is not None and y.logprobs is not None
            assert x.token_ids[first] in y.logprobs[first]
            assert y.token_ids[first] in x.logprobs[first]
