"""``use_beam_search`` on both APIs: the beams equal a plain beam search over transformers'
log-probabilities of the served model; streaming sends each beam whole; fields a beam search
does not apply are refused by name; a search cut by its timeout leaves the engine idle."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer, LlamaForCausalLM

from tests.engine.tiny_models import hf_beam_search
from tests.entrypoints.openai.server_utils import API_KEY, ServerProcess
from tests.reliability.reliability_utils import wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "Name a city"}]
BEAMS = {"use_beam_search": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Any:
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype="float32").eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Any:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
        yield client


def _ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()


def test_completion_beams_equal_the_reference(http: httpx.Client, reference: Any) -> None:
    model, tokenizer = reference
    body = _ok(http.post("/v1/completions", json={
        "prompt": "Hello world", "n": 3, "max_tokens": 4, "return_token_ids": True, **BEAMS}))
    expected = hf_beam_search(model, tokenizer.encode("Hello world"), 3, 4)
    assert [c["token_ids"] for c in body["choices"]] == [tokens for tokens, _ in expected]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == [
        tokenizer.decode(tokens, skip_special_tokens=True) for tokens, _ in expected]
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 12


def test_chat_beams_and_their_stream(http: httpx.Client, reference: Any) -> None:
    model, tokenizer = reference
    request = {"messages": MESSAGES, "n": 2, "max_completion_tokens": 3, **BEAMS}
    body = _ok(http.post("/v1/chat/completions", json=request))
    prompt_ids = _ok(http.post("/tokenize", json={"messages": MESSAGES}))["tokens"]
    expected = hf_beam_search(model, prompt_ids, 2, 3)
    texts = [c["message"]["content"] for c in body["choices"]]
    assert texts == [tokenizer.decode(t, skip_special_tokens=True) for t, _ in expected]
    streamed = {0: "", 1: ""}
    finishes = {}
    with http.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                streamed[choice["index"]] += choice["delta"].get("content") or ""
                if choice["finish_reason"]:
                    finishes[choice["index"]] = choice["finish_reason"]
    assert [streamed[0], streamed[1]] == texts and finishes == {0: "length", 1: "length"}


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/completions", {"top_p": 0.5}, "top_p"),
    ("/v1/completions", {"n": 11}, "n"),
    ("/v1/completions", {"temperature": 0.7}, "temperature"),
    ("/v1/completions", {"logprobs": 2}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"stop": ["x"]}, "stop"),
])
def test_fields_a_beam_search_does_not_apply_are_refused(
    http: httpx.Client, path: str, fields: dict[str, Any], param: str
) -> None:
    base = {"messages": MESSAGES} if "chat" in path else {"prompt": "Hi"}
    response = http.post(path, json={**base, **BEAMS, "max_tokens": 2, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_length_penalty_needs_beam_search(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"prompt": "Hi", "length_penalty": 0.5})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "length_penalty"


def test_a_search_past_its_timeout_is_aborted(http: httpx.Client, server: ServerProcess) -> None:
    response = http.post("/v1/completions", json={
        "prompt": "Hello", "n": 4, "max_tokens": 200, "timeout": 0.5, **BEAMS})
    assert response.status_code == 408, response.text
    wait_idle(server.url, timeout=10.0)
    # The engine still serves.
    assert _ok(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}))
