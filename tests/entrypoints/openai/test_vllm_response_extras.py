"""vLLM's extra request fields on both APIs: ``prompt_logprobs``, ``return_token_ids``,
``truncate_prompt_tokens``, ``allowed_token_ids``, ``bad_words``, ``return_tokens_as_token_ids``,
``cache_salt``, ``request_id`` (and the X-Request-Id header), echo with ``max_tokens: 0``,
``stream_options.continuous_usage_stats`` and completions' ``add_special_tokens``, against a real
server."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from pagedserve.entrypoints.openai.protocol import CompletionRequest
from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tests.entrypoints.openai.server_utils import API_KEY, ServerProcess

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The quick brown fox"
LONG_PROMPT = " ".join([PROMPT] * 12)
"""Longer than a KV block: a second request finds it in the prefix cache."""
MESSAGES = [{"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0.0, "ignore_eos": True}
FIRST_TOKEN_IS_A_WORD = "Paris is the capital of"
"""The tiny model's greedy first token after it (as a prompt and as a user message) is a token
whose text tokenizes back to it alone (a byte of a character would not)."""


def _post(server: ServerProcess, path: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=60)


def _ok(server: ServerProcess, path: str, **body: Any) -> dict[str, Any]:
    r = _post(server, path, **body)
    assert r.status_code == 200, r.text
    return r.json()


def _chunks(server: ServerProcess, path: str, **body: Any) -> list[dict[str, Any]]:
    r = _post(server, path, stream=True, **body)
    assert r.status_code == 200, r.text
    lines = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _refused(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err["message"]


def _tokenize(server: ServerProcess, **body: Any) -> list[int]:
    return _ok(server, "/tokenize", **body)["tokens"]


def _detokenize(server: ServerProcess, ids: list[int]) -> str:
    return _ok(server, "/detokenize", tokens=ids)["prompt"]


# ---- prompt_logprobs -------------------------------------------------------------------------


def test_completion_prompt_logprobs_match_echo_logprobs(
    server: ServerProcess, model_name: str
) -> None:
    ids = _tokenize(server, prompt=LONG_PROMPT)
    body = _ok(server, "/v1/completions", model=model_name, prompt=LONG_PROMPT, max_tokens=2,
               prompt_logprobs=2, **GREEDY)
    echoed = _ok(server, "/v1/completions", model=model_name, prompt=LONG_PROMPT, max_tokens=2,
                 echo=True, logprobs=2, **GREEDY)
    prompt_lps = body["choices"][0]["prompt_logprobs"]
    assert body["choices"][0]["logprobs"] is None
    # The same prompt again (its blocks are cached now): every position again.
    again = _ok(server, "/v1/completions", model=model_name, prompt=LONG_PROMPT, max_tokens=2,
                prompt_logprobs=2, **GREEDY)
    again_lps = again["choices"][0]["prompt_logprobs"]
    assert len(again_lps) == len(ids) and again_lps[0] is None
    for a, b in zip(again_lps[1:], prompt_lps[1:], strict=True):
        assert a.keys() == b.keys()
        assert all(a[t]["logprob"] == pytest.approx(b[t]["logprob"], abs=1e-4) for t in a)
    assert len(prompt_lps) == len(ids) and prompt_lps[0] is None
    echo_values = echoed["choices"][0]["logprobs"]["token_logprobs"][: len(ids)]
    for token_id, position, echo_value in zip(ids[1:], prompt_lps[1:], echo_values[1:],
                                              strict=True):
        # The prompt's token is always there, with its true rank; the others are ranks 1..2.
        entry = position[str(token_id)]
        assert entry["logprob"] == pytest.approx(echo_value, abs=1e-5)
        assert entry["rank"] >= 1 and entry["decoded_token"] == _detokenize(server, [token_id])
        others = {int(t): e for t, e in position.items() if int(t) != token_id}
        assert sorted(e["rank"] for e in others.values()) == [
            r for r in (1, 2) if r != entry["rank"]]
        best = max(e["logprob"] for e in position.values())
        assert best == pytest.approx(next(e["logprob"] for e in position.values()
                                          if e["rank"] == 1))


def test_chat_prompt_logprobs_cover_the_rendered_conversation(
    server: ServerProcess, model_name: str
) -> None:
    ids = _tokenize(server, messages=MESSAGES)
    body = _ok(server, "/v1/chat/completions", model=model_name, messages=MESSAGES,
               max_tokens=2, prompt_logprobs=0, **GREEDY)
    prompt_lps = body["prompt_logprobs"]
    assert len(prompt_lps) == len(ids) and prompt_lps[0] is None
    # prompt_logprobs 0: the prompt's token alone at each position.
    assert [list(map(int, p)) for p in prompt_lps[1:]] == [[t] for t in ids[1:]]
    assert all(p[str(t)]["logprob"] <= 0 for p, t in zip(prompt_lps[1:], ids[1:], strict=True))


def test_prompt_logprobs_are_refused_with_stream_and_above_the_cap(
    server: ServerProcess, model_name: str
) -> None:
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        message = _refused(_post(server, path, model=model_name, stream=True, prompt_logprobs=1,
                                 **body), "prompt_logprobs")
        assert "stream" in message
        _refused(_post(server, path, model=model_name, prompt_logprobs=21, **body),
                 "prompt_logprobs")


# ---- return_token_ids ------------------------------------------------------------------------


def test_completion_return_token_ids_full_and_streamed(
    server: ServerProcess, model_name: str
) -> None:
    full = _ok(server, "/v1/completions", model=model_name, prompt=PROMPT, max_tokens=6,
               return_token_ids=True, **GREEDY)["choices"][0]
    assert full["prompt_token_ids"] == _tokenize(server, prompt=PROMPT)
    assert len(full["token_ids"]) == 6 and _detokenize(server, full["token_ids"]) == full["text"]
    plain = _ok(server, "/v1/completions", model=model_name, prompt=PROMPT, max_tokens=6,
                **GREEDY)["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None

    chunks = _chunks(server, "/v1/completions", model=model_name, prompt=PROMPT, max_tokens=6,
                     return_token_ids=True, **GREEDY)
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert all(c["prompt_token_ids"] is None for c in choices[1:])
    assert [t for c in choices for t in c["token_ids"]] == full["token_ids"]


def test_chat_return_token_ids_full_and_streamed(server: ServerProcess, model_name: str) -> None:
    body = _ok(server, "/v1/chat/completions", model=model_name, messages=MESSAGES, max_tokens=5,
               n=2, seed=3, temperature=1.0, ignore_eos=True, return_token_ids=True)
    assert body["prompt_token_ids"] == _tokenize(server, messages=MESSAGES)
    assert [len(choice["token_ids"]) for choice in body["choices"]] == [5, 5]
    assert body["choices"][0]["token_ids"] != body["choices"][1]["token_ids"]

    chunks = _chunks(server, "/v1/chat/completions", model=model_name, messages=MESSAGES,
                     max_tokens=5, n=2, seed=3, temperature=1.0, ignore_eos=True,
                     return_token_ids=True)
    assert chunks[0]["prompt_token_ids"] == body["prompt_token_ids"]
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    for choice in body["choices"]:
        streamed = [t for c in chunks for ch in c["choices"] if ch["index"] == choice["index"]
                    for t in ch["token_ids"] or []]
        assert streamed == choice["token_ids"]


# ---- truncate_prompt_tokens, allowed_token_ids ----------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_truncate_prompt_tokens_and_allowed_token_ids(
    server: ServerProcess, model_name: str, path: str
) -> None:
    body = {"prompt": LONG_PROMPT} if path == "/v1/completions" else {"messages": [
        {"role": "user", "content": LONG_PROMPT}]}
    full = _ok(server, path, model=model_name, max_tokens=1, **body)["usage"]["prompt_tokens"]
    assert full > 12
    cut = _ok(server, path, model=model_name, max_tokens=8, truncate_prompt_tokens=12,
              allowed_token_ids=[40, 41, 42], temperature=1.0, seed=1, ignore_eos=True,
              return_token_ids=True, **body)
    assert cut["usage"]["prompt_tokens"] == 12
    token_ids = cut["choices"][0]["token_ids"]
    assert len(token_ids) == 8 and set(token_ids) <= {40, 41, 42}
    _refused(_post(server, path, model=model_name, allowed_token_ids=[], **body),
             "allowed_token_ids")
    _refused(_post(server, path, model=model_name, truncate_prompt_tokens=0, **body),
             "truncate_prompt_tokens")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_words_change_the_greedy_first_token(
    server: ServerProcess, model_name: str, path: str
) -> None:
    body: dict[str, Any] = {"prompt": FIRST_TOKEN_IS_A_WORD} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": FIRST_TOKEN_IS_A_WORD}]}

    def token_ids(**fields: Any) -> list[int]:
        choice = _ok(server, path, model=model_name, max_tokens=3, return_token_ids=True,
                     **GREEDY, **body, **fields)["choices"][0]
        return choice["token_ids"]

    first = token_ids()[0]
    word = _detokenize(server, [first])
    assert _tokenize(server, prompt=word.lstrip(), add_special_tokens=False) == [first], word
    assert token_ids(bad_words=[word])[0] != first
    assert token_ids(bad_words=["unrelated"])[0] == first
    _refused(_post(server, path, model=model_name, bad_words=[word, ""], **body), "bad_words")
    message = _refused(_post(server, path, model=model_name, bad_words=["xyzzy" * 5], **body),
                       "bad_words")
    assert "more than 16" in message


# ---- return_tokens_as_token_ids, cache_salt --------------------------------------------------


def test_return_tokens_as_token_ids(server: ServerProcess, model_name: str) -> None:
    completion = _ok(server, "/v1/completions", model=model_name, prompt=PROMPT, max_tokens=3,
                     logprobs=2, echo=True, return_tokens_as_token_ids=True,
                     return_token_ids=True, **GREEDY)["choices"][0]
    ids = completion["prompt_token_ids"] + completion["token_ids"]
    lists = completion["logprobs"]
    assert lists["tokens"] == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in lists["top_logprobs"][1:] for k in top)
    chat = _ok(server, "/v1/chat/completions", model=model_name, messages=MESSAGES,
               max_tokens=3, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True,
               return_token_ids=True, **GREEDY)["choices"][0]
    entries = chat["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in chat["token_ids"]]
    assert entries[0]["bytes"] == list(entries[0]["token"].encode())
    assert all(top["token"].startswith("token_id:") for e in entries for top in e["top_logprobs"])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_cache_salt_keeps_prefix_hits_within_a_salt(
    server: ServerProcess, model_name: str, path: str
) -> None:
    text = f"{path} salted: {LONG_PROMPT}"  # a prompt no other test sends
    body = {"prompt": text} if path == "/v1/completions" else {"messages": [
        {"role": "user", "content": text}]}

    def cached(**fields: Any) -> int:
        usage = _ok(server, path, model=model_name, max_tokens=1, **body, **fields)["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-b") == 0 and cached() == 0
    assert cached(cache_salt="tenant-a") > 0 and cached() > 0
    _refused(_post(server, path, model=model_name, cache_salt="", **body), "cache_salt")


# ---- echo with max_tokens 0 ------------------------------------------------------------------


def test_echo_with_max_tokens_zero_returns_the_prompt_alone(
    server: ServerProcess, model_name: str
) -> None:
    ids = _tokenize(server, prompt=PROMPT)
    body = _ok(server, "/v1/completions", model=model_name, prompt=PROMPT, max_tokens=0,
               echo=True, logprobs=1, return_token_ids=True)
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and choice["token_ids"] == []
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert all(v <= 0 for v in choice["logprobs"]["token_logprobs"][1:])
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(ids)

    chunks = _chunks(server, "/v1/completions", model=model_name, prompt=PROMPT, max_tokens=0,
                     echo=True)
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    message = _refused(_post(server, "/v1/completions", model=model_name, prompt=PROMPT,
                             max_tokens=0), "max_tokens")
    assert "echo" in message


# ---- stream_options.continuous_usage_stats ---------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats(server: ServerProcess, model_name: str, path: str) -> None:
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    chunks = _chunks(server, path, model=model_name, max_tokens=5, **GREEDY, **body,
                     stream_options={"include_usage": True, "continuous_usage_stats": True})
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    prompt_tokens = {c["usage"]["prompt_tokens"] for c in chunks}
    assert len(prompt_tokens) == 1
    plain = _chunks(server, path, model=model_name, max_tokens=2, **body,
                    stream_options={"include_usage": True})
    assert all(c["usage"] is None for c in plain[:-1])
    _refused(_post(server, path, model=model_name, stream=True, **body,
                   stream_options={"continuous_usage_stats": True}),
             "stream_options.continuous_usage_stats")


# ---- add_special_tokens ----------------------------------------------------------------------


class _RecordingEngine:
    """What the completions server asks the engine's tokenizer for."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, bool]] = []

    async def encode_async(self, field: str, text: str, add_special_tokens: bool) -> list[int]:
        self.calls.append((field, text, add_special_tokens))
        return [7, 8]


def test_add_special_tokens_false_tokenizes_text_prompts_without_them() -> None:
    engine = _RecordingEngine()
    serving = SimpleNamespace(engine=engine)

    def engine_prompt(body: dict[str, Any], prompt: str | list[int]) -> Any:
        request = CompletionRequest.model_validate({"prompt": prompt, **body})
        return asyncio.run(OpenAIServingCompletion._engine_prompt(serving, request, prompt))

    assert engine_prompt({}, "hi") == "hi"  # the engine's own tokenizing adds them
    assert engine_prompt({"add_special_tokens": False}, [5, 6]) == [5, 6]
    assert engine.calls == []
    assert engine_prompt({"add_special_tokens": False}, "hi") == {
        "prompt": "hi", "prompt_token_ids": [7, 8]}
    assert engine.calls == [("prompt", "hi", False)]


def test_add_special_tokens_is_refused_on_chat(server: ServerProcess, model_name: str) -> None:
    message = _refused(_post(server, "/v1/chat/completions", model=model_name, messages=MESSAGES,
                             add_special_tokens=True), "add_special_tokens")
    assert "chat template" in message


def test_request_id_names_the_response_and_may_repeat(server: ServerProcess) -> None:
    """vLLM's ``request_id`` field and X-Request-Id header give the response's id after its
    prefix (the header wins); two requests with one id at once both run."""
    body = {"prompt": PROMPT, "max_tokens": 2, "request_id": "abc-1"}
    assert _ok(server, "/v1/completions", **body)["id"] == "cmpl-abc-1"
    chat = {"messages": MESSAGES, "max_tokens": 2, "request_id": "abc-2"}
    assert _ok(server, "/v1/chat/completions", **chat)["id"] == "chatcmpl-abc-2"
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat,
                   headers={**AUTH, "X-Request-Id": "from-header"}, timeout=60)
    assert r.json()["id"] == "chatcmpl-from-header"
    assert _post(server, "/v1/completions", **{**body, "request_id": ""}).status_code == 400

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as http:
            long = {**body, "max_tokens": 24, "stream": True, **GREEDY}
            return await asyncio.gather(*(http.post("/v1/completions", json=long)
                                          for _ in range(2)))

    for response in asyncio.run(both()):
        assert response.status_code == 200
        chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        assert {c["id"] for c in chunks} == {"cmpl-abc-1"}
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
