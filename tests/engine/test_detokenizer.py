"""Incremental detokenization and stop strings, against the tokenizer's full decode."""

from __future__ import annotations

import random

import pytest

from pagedserve.core.sched_output import LogprobsLists
from pagedserve.engine.detokenizer import (
    IncrementalDetokenizer,
    check_stop_strings,
    decode_logprobs,
)
from pagedserve.sampling_params import SamplingParams
from tests.engine.tiny_models import make_tokenizer

TEXTS = [
    "Hello world! naïve café 日本語 🎉 done.",
    "The quick brown fox ✓ Zürich テスト",
    "🎉🎉 emoji-first, then words",
]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def _feed(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    """Feed ``ids`` in random-sized groups; returns the deltas streamed after each group."""
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        detok.update(ids[i : i + n], stop_terminated=False)
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
        i += n
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Prompt: ")
    ids = tokenizer.encode(text)
    assert any(tokenizer.decode([i]).endswith("\ufffd") for i in ids), "needs split characters"
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    deltas = _feed(detok, ids, random.Random(0))
    assert detok.output_text == text
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_leading_space_of_first_token_kept(tokenizer):
    prompt = tokenizer.encode("Hello")
    ids = tokenizer.encode(" world")
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    detok.update(ids, stop_terminated=False)
    assert detok.output_text == " world"


@pytest.mark.parametrize(
    ("text", "new", "stop", "include", "expected"),
    [
        ("abc STOP tail", 6, ["STOP"], False, ("STOP", 4)),  # "P" is new
        ("abc STOP tail", 6, ["STOP"], True, ("STOP", 8)),
        ("abc STOP tail", 5, ["STOP"], False, None),  # already searched in an earlier step
        ("xx yy", 2, ["yy", "x yy"], False, ("x yy", 1)),  # the earliest match wins
        ("nothing", 7, ["zz"], False, None),
    ],
)
def test_check_stop_strings(text, new, stop, include, expected):
    assert check_stop_strings(text, new, stop, include) == expected


def _ids_one_char_per_token(tokenizer, text: str) -> list[int]:
    """Token ids for ``text`` split at every character (forces matches across tokens)."""
    return [i for ch in text for i in tokenizer.encode(ch)]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(tokenizer, include):
    text = "Hello world. Stop here please"
    stop = "ld. St"
    ids = _ids_one_char_per_token(tokenizer, text)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tokenizer, [1], params)
    streamed, found = [], None
    for token_id in ids:
        found = detok.update([token_id], stop_terminated=False)
        streamed.append(detok.get_next_output_text(finished=found is not None, delta=True))
        if found is not None:
            break
    expected = "Hello world. St" if include else "Hello wor"
    assert found == stop
    assert detok.output_text == expected
    assert "".join(streamed) == expected  # nothing of a stop string leaked while streaming


def test_min_tokens_suppresses_stop_strings(tokenizer):
    ids = _ids_one_char_per_token(tokenizer, "ab ab ab")
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["ab"], min_tokens=4))
    results = [detok.update([t], stop_terminated=False) for t in ids[:5]]
    # Tokens 1-4 ("ab a") are inside min_tokens: the "ab" they hold is not a stop; the first
    # one that ends beyond them is the one completed by token 5.
    assert results == [None] * 4 + ["ab"]
    assert detok.output_text == "ab "


def test_stop_token_text_excluded_unless_asked(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("done") + [eos]
    for include, expected in ((False, "done"), (True, "done<|endoftext|>")):
        params = SamplingParams(include_stop_str_in_output=include, skip_special_tokens=False)
        detok = IncrementalDetokenizer(tokenizer, [1], params)
        detok.update(ids, stop_terminated=True)
        assert detok.output_text == expected


def test_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("a<|im_start|>b")
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in ids
    for skip, expected in ((True, "ab"), (False, "a<|im_start|>b")):
        detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(skip_special_tokens=skip))
        detok.update(ids, stop_terminated=False)
        assert detok.output_text == expected


def test_cumulative_text_holds_back_possible_stop_prefix(tokenizer):
    ids = _ids_one_char_per_token(tokenizer, "abcX")
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["XYZ"]))
    detok.update(ids, stop_terminated=False)
    assert detok.get_next_output_text(finished=False, delta=False) == "ab"
    assert detok.get_next_output_text(finished=True, delta=False) == "abcX"


def test_decode_logprobs(tokenizer):
    a, b, c = tokenizer.encode("a")[0], tokenizer.encode("b")[0], tokenizer.encode("c")[0]
    rows = LogprobsLists(
        token_ids=[[b, a, b], [c, a, b]],
        logprobs=[[-0.9, -0.5, -0.9], [-3.0, -0.1, -0.2]],
        ranks=[2, 7],
    )
    first, second = decode_logprobs(tokenizer, rows)
    assert list(first) == [b, a]  # the sampled token first, counted once
    assert first[b].rank == 2 and first[b].decoded_token == "b"
    assert first[a].rank == 1 and first[a].logprob == -0.5
    assert list(second) == [c, a, b] and second[c].rank == 7 and second[b].rank == 2
