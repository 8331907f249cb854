"""``/v1/completions`` through the official ``openai`` client against a real server."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.entrypoints.openai.server_utils import API_KEY, MAX_MODEL_LEN, ServerProcess

PROMPTS = ["Hello world", "The quick brown fox"]
NO_EOS = {"ignore_eos": True}


def _greedy(client: openai.OpenAI, model: str, prompt, max_tokens: int = 8, **kwargs):
    return client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body=NO_EOS,
        **kwargs,
    )


def _tokenize(server: ServerProcess, text: str) -> list[int]:
    r = httpx.post(
        f"{server.url}/tokenize",
        json={"prompt": text},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    r.raise_for_status()
    return r.json()["tokens"]


def test_greedy_equals_offline_llm(
    client: openai.OpenAI, model_name: str, tiny_model_dir: Path
) -> None:
    from pagedserve import LLM, SamplingParams

    served = _greedy(client, model_name, PROMPTS)
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN)
    offline = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [c.text for c in served.choices] == [o.outputs[0].text for o in offline]
    assert [c.index for c in served.choices] == [0, 1]
    assert served.usage.completion_tokens == 16
    assert served.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in offline)


def test_usage_max_tokens_and_token_prompts(
    client: openai.OpenAI, server: ServerProcess, model_name: str
) -> None:
    ids = _tokenize(server, "Paris is the capital")
    by_text = _greedy(client, model_name, "Paris is the capital", max_tokens=7)
    by_ids = _greedy(client, model_name, ids, max_tokens=7)
    for response in (by_text, by_ids):
        assert response.object == "text_completion" and response.model == model_name
        assert response.usage.prompt_tokens == len(ids)
        assert response.usage.completion_tokens == 7
        assert response.usage.total_tokens == len(ids) + 7
        assert response.choices[0].finish_reason == "length"
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_streaming_matches_non_streaming(client: openai.OpenAI, model_name: str) -> None:
    full = _greedy(client, model_name, PROMPTS, max_tokens=10)
    texts = {0: "", 1: ""}
    finish = {}
    usage = None
    for chunk in _greedy(
        client,
        model_name,
        PROMPTS,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    assert [texts[0], texts[1]] == [c.text for c in full.choices]
    assert finish == {0: "length", 1: "length"}
    assert usage is not None and usage.model_dump() == full.usage.model_dump()


def test_n2_and_seed_reproducibility(client: openai.OpenAI, model_name: str) -> None:
    def sample(seed: int) -> list[str]:
        response = client.completions.create(
            model=model_name,
            prompt="Hello",
            n=2,
            max_tokens=8,
            temperature=1.0,
            seed=seed,
            extra_body=NO_EOS,
        )
        assert [c.index for c in response.choices] == [0, 1]
        assert response.usage.completion_tokens == 16
        return [c.text for c in response.choices]

    first = sample(1234)
    assert sample(1234) == first
    assert first[0] != first[1], "the n completions of a seeded request must differ"
    assert sample(99) != first


def test_logprobs_legacy_format(client: openai.OpenAI, model_name: str) -> None:
    response = _greedy(client, model_name, "Hello world", max_tokens=4, logprobs=3)
    lp = response.choices[0].logprobs
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    )
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        # Keys are token strings: byte tokens that all decode to U+FFFD share one key.
        assert logprob <= 0.0 and 1 <= len(top) <= 4
        # Greedy: the sampled token is the most likely one.
        assert logprob >= max(top.values()) - 1e-4
    assert lp.text_offset[0] == 0
    assert all(
        b - a == len(t)
        for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens, strict=False)
    )


def test_echo_with_logprobs(client: openai.OpenAI, server: ServerProcess, model_name: str) -> None:
    prompt = "Hello world"
    plain = _greedy(client, model_name, prompt, max_tokens=3)
    echoed = _greedy(client, model_name, prompt, max_tokens=3, echo=True, logprobs=1)
    choice = echoed.choices[0]
    assert choice.text == prompt + plain.choices[0].text
    num_prompt = len(_tokenize(server, prompt))
    assert len(choice.logprobs.tokens) == num_prompt + 3
    assert choice.logprobs.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in choice.logprobs.token_logprobs[1:])
    assert choice.logprobs.text_offset[num_prompt] == len(prompt)


def test_stop_string(client: openai.OpenAI, model_name: str) -> None:
    text = _greedy(client, model_name, "The quick brown fox", max_tokens=16).choices[0].text
    visible = [i for i in range(2, len(text) - 1) if text[i].isalnum()]
    if not visible:
        pytest.skip(f"the tiny model's continuation has no letter to stop at: {text!r}")
    at = visible[0]
    stop = text[at]
    stopped = _greedy(client, model_name, "The quick brown fox", max_tokens=16, stop=[stop])
    choice = stopped.choices[0]
    assert choice.text == text[: text.index(stop)]
    assert choice.finish_reason == "stop"
    assert choice.model_extra.get("stop_reason") == stop
    streamed = "".join(
        c.choices[0].text
        for c in _greedy(
            client, model_name, "The quick brown fox", max_tokens=16, stop=[stop], stream=True
        )
        if c.choices
    )
    assert streamed == choice.text


def test_sampling_extras_are_accepted(client: openai.OpenAI, model_name: str) -> None:
    response = client.completions.create(
        model=model_name,
        prompt="Hello",
        max_tokens=4,
        temperature=0.8,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"5": 1.0},
        user="tester",
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 4,
            "ignore_eos": False,
            "include_stop_str_in_output": True,
            "skip_special_tokens": True,
        },
    )
    assert response.usage.completion_tokens == 4  # min_tokens == max_tokens: no early stop
