"""SamplingParams.clone: an equal copy that shares no mutable field with the original; values
of the wrong type (or an empty allowed_token_ids, or bad words past their caps) refused, naming
the field."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.sampling_params import (
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_BAD_WORDS_TOKEN_IDS,
    SamplingParams,
)


def test_clone_is_equal_and_owns_its_containers() -> None:
    params = SamplingParams(n=2, seed=3, stop=["x"], stop_token_ids=[7], logit_bias={5: 1.5},
                            allowed_token_ids=[4, 2], max_tokens=9, logprobs=2)
    twin = params.clone()
    assert twin == params and twin is not params
    twin.stop.append("y")
    twin.stop_token_ids.append(8)
    twin.logit_bias[6] = -1.0
    twin.allowed_token_ids.append(9)
    twin.max_tokens = 4
    assert params.stop == ["x"] and params.stop_token_ids == [7]
    assert params.logit_bias == {5: 1.5} and params.max_tokens == 9
    assert params.allowed_token_ids == [4, 2]


def test_clone_owns_its_bad_words() -> None:
    params = SamplingParams(bad_words=["foo"], bad_words_token_ids=[[1, 2], [3]])
    twin = params.clone()
    assert twin == params
    twin.bad_words.append("bar")
    twin.bad_words_token_ids[0].append(9)
    twin.bad_words_token_ids.append([4])
    assert params.bad_words == ["foo"] and params.bad_words_token_ids == [[1, 2], [3]]


def test_clone_without_logit_bias() -> None:
    twin = SamplingParams().clone()
    assert twin.logit_bias is None and twin.allowed_token_ids is None
    assert twin.bad_words is None and twin.bad_words_token_ids is None
    assert twin == SamplingParams()


@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": "hot"}, "temperature: expected float"),
    ({"max_tokens": 1.5}, "max_tokens: expected int or None"),
    ({"top_k": True}, "top_k: expected int"),
    ({"ignore_eos": "yes"}, "ignore_eos: expected bool"),
    ({"seed": "x"}, "seed: expected int or None"),
    ({"stop": 5}, "stop: expected a string or a list of strings"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids: expected a list of token ids"),
    ({"logit_bias": {"a": 1.0}}, "logit_bias: 'a' is not a token id"),
    ({"logit_bias": {"5": "x"}}, "logit_bias: the bias for token '5' is not a number"),
    ({"logit_bias": [1, 2]}, "logit_bias: expected a dict"),
    ({"allowed_token_ids": 5}, "allowed_token_ids: expected a list of token ids"),
    ({"allowed_token_ids": [1.5]}, "allowed_token_ids: expected a list of token ids"),
    ({"allowed_token_ids": [True]}, "allowed_token_ids: expected a list of token ids"),
    ({"allowed_token_ids": ["3"]}, "allowed_token_ids: expected a list of token ids"),
    ({"bad_words": "foo"}, "bad_words: expected a list of strings"),
    ({"bad_words": ["a", 3]}, "bad_words: expected a list of strings"),
    ({"bad_words_token_ids": [1, 2]}, "bad_words_token_ids: expected a list of token ids"),
    ({"bad_words_token_ids": [[1.5]]}, "bad_words_token_ids: expected a list of token ids"),
    ({"bad_words_token_ids": [[True]]}, "bad_words_token_ids: expected a list of token ids"),
    ({"bad_words_token_ids": 5}, "bad_words_token_ids: expected a list of token id lists"),
])
def test_a_value_of_the_wrong_type_is_refused_naming_its_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}"):
        SamplingParams(**kwargs)


def test_json_shaped_values_are_taken_as_their_python_types() -> None:
    params = SamplingParams(temperature=1, stop=("a", "b"), stop_token_ids=[np.int64(7)],
                            logit_bias={"5": 2}, allowed_token_ids=(np.int32(3), 1),
                            max_tokens=np.int64(9))
    assert params.temperature == 1 and params.stop == ["a", "b"]
    assert params.stop_token_ids == [7] and type(params.stop_token_ids[0]) is int
    assert params.logit_bias == {5: 2.0}
    assert params.allowed_token_ids == [3, 1] and type(params.allowed_token_ids[0]) is int


@pytest.mark.parametrize("ids", [[], ()])
def test_empty_allowed_token_ids_refused(ids: list[int]) -> None:
    """vLLM refuses it too: it would allow no token at all (None allows every one)."""
    with pytest.raises(ValueError, match="^allowed_token_ids: an empty list"):
        SamplingParams(allowed_token_ids=ids)


def test_allowed_token_ids_above_the_cap_refused() -> None:
    assert len(SamplingParams(allowed_token_ids=list(range(2048))).allowed_token_ids) == 2048
    with pytest.raises(ValueError, match="^allowed_token_ids: at most 2048 ids, got 2049"):
        SamplingParams(allowed_token_ids=list(range(2049)))


@pytest.mark.parametrize("keep", [0, -2])
def test_truncate_prompt_tokens_out_of_range_refused(keep: int) -> None:
    with pytest.raises(ValueError, match="^truncate_prompt_tokens must be -1"):
        SamplingParams(truncate_prompt_tokens=keep)


@pytest.mark.parametrize("temperature", [-0.5, 100.5, 1e308, float("inf")])
def test_temperature_out_of_range_refused(temperature: float) -> None:
    """A huge temperature overflows the scaled logits to infinity in float32 (min_tokens' masked
    EOS then wins every draw): refused offline as on the server."""
    with pytest.raises(ValueError, match="^temperature must be in"):
        SamplingParams(temperature=temperature)


def test_temperature_at_the_cap_accepted() -> None:
    assert SamplingParams(temperature=100.0).temperature == 100.0


def test_bad_words_and_their_token_ids_in_json_shapes_are_kept() -> None:
    params = SamplingParams(bad_words=("foo", " bar"), bad_words_token_ids=((np.int64(3), 4),))
    assert params.bad_words == ["foo", " bar"]
    assert params.bad_words_token_ids == [[3, 4]] and type(params.bad_words_token_ids[0][0]) is int
    assert SamplingParams(bad_words=[], bad_words_token_ids=[]).bad_words_token_ids == []


@pytest.mark.parametrize("words", [[""], ["ok", " "], ["\n\t"]])
def test_empty_bad_words_refused(words: list[str]) -> None:
    with pytest.raises(ValueError, match="^bad_words: every word must be a non-empty string"):
        SamplingParams(bad_words=words)


def test_bad_words_above_the_caps_refused() -> None:
    SamplingParams(bad_words=["w"] * MAX_BAD_WORDS,
                   bad_words_token_ids=[[1] * MAX_BAD_WORD_TOKENS] * MAX_BAD_WORDS_TOKEN_IDS)
    with pytest.raises(ValueError, match=f"^bad_words: at most {MAX_BAD_WORDS} words, got"):
        SamplingParams(bad_words=["w"] * (MAX_BAD_WORDS + 1))
    with pytest.raises(ValueError, match=f"^bad_words_token_ids: at most {MAX_BAD_WORDS_TOKEN_IDS}"):
        SamplingParams(bad_words_token_ids=[[1]] * (MAX_BAD_WORDS_TOKEN_IDS + 1))
    with pytest.raises(ValueError, match="^bad_words_token_ids: each sequence must have 1 to 16"):
        SamplingParams(bad_words_token_ids=[[1] * (MAX_BAD_WORD_TOKENS + 1)])
    with pytest.raises(ValueError, match="^bad_words_token_ids: each sequence must have 1 to 16"):
        SamplingParams(bad_words_token_ids=[[2], []])
