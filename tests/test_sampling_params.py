"""SamplingParams.clone: an equal copy that shares no mutable field with the original."""

from __future__ import annotations

from pagedserve.sampling_params import SamplingParams


def test_clone_is_equal_and_owns_its_containers() -> None:
    params = SamplingParams(n=2, seed=3, stop=["x"], stop_token_ids=[7], logit_bias={5: 1.5},
                            max_tokens=9, logprobs=2)
    twin = params.clone()
    assert twin == params and twin is not params
    twin.stop.append("y")
    twin.stop_token_ids.append(8)
    twin.logit_bias[6] = -1.0
    twin.max_tokens = 4
    assert params.stop == ["x"] and params.stop_token_ids == [7]
    assert params.logit_bias == {5: 1.5} and params.max_tokens == 9


def test_clone_without_logit_bias() -> None:
    twin = SamplingParams().clone()
    assert twin.logit_bias is None and twin == SamplingParams()
