"""Every field of OpenAI's chat and completions request schemas (read from the openai package)
and of vLLM's extras either is used by the server or is refused with a 400 naming it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from openai.types.chat.chat_completion_assistant_message_param import (
    ChatCompletionAssistantMessageParam,
)
from openai.types.chat.chat_completion_stream_options_param import (
    ChatCompletionStreamOptionsParam,
)
from openai.types.chat.completion_create_params import (
    CompletionCreateParamsBase as ChatCreateParams,
)
from openai.types.completion_create_params import CompletionCreateParamsBase

from pagedserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from pagedserve.entrypoints.openai.unsupported_fields import UNSUPPORTED_FIELDS
from tests.entrypoints.openai.server_utils import API_KEY, ServerProcess

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "Hello"}]


def _keys(typed_dict: Any) -> set[str]:
    return set(typed_dict.__required_keys__ | typed_dict.__optional_keys__)


OPENAI_CHAT = _keys(ChatCreateParams) | {"stream"}
OPENAI_COMPLETIONS = _keys(CompletionCreateParamsBase) | {"stream"}
VLLM_CHAT_EXTRAS = {
    "best_of", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "prompt_logprobs", "allowed_token_ids", "bad_words", "echo", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "documents", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs", "media_io_kwargs", "structured_outputs",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag",
    "guided_decoding_backend", "guided_whitespace_pattern", "priority", "request_id",
    "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
    "kv_transfer_params", "vllm_xargs", "include_reasoning",
}
VLLM_COMPLETION_EXTRAS = (VLLM_CHAT_EXTRAS - {
    "add_generation_prompt", "continue_final_message", "documents", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs", "media_io_kwargs", "include_reasoning",
}) | {"prompt_embeds", "response_format"}

SAMPLES: dict[str, Any] = {
    # Implemented: a value that is not the default.
    "frequency_penalty": 1.0, "presence_penalty": 1.0, "logit_bias": {"5": 10.0},
    "logprobs": True, "top_logprobs": 2, "max_tokens": 3, "max_completion_tokens": 3, "n": 2,
    "seed": 7, "stop": ["x"], "temperature": 0.5, "top_p": 0.5, "top_k": 5, "min_p": 0.1,
    "repetition_penalty": 1.5, "stop_token_ids": [5], "include_stop_str_in_output": True,
    "ignore_eos": True, "min_tokens": 2, "skip_special_tokens": False,
    "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "[ab]+"},
    "guided_json": {"type": "object"}, "guided_regex": "[ab]+", "guided_choice": ["a", "b"],
    "guided_grammar": 'root ::= "a"', "use_beam_search": True, "length_penalty": 0.5,
    # Refused: a value a client would send.
    "functions": [{"name": "f"}], "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text"],
    "prediction": {"type": "content", "content": "x"}, "service_tier": "auto", "store": True,
    "metadata": {"k": "v"}, "reasoning_effort": "low", "verbosity": "low",
    "web_search_options": {}, "prompt_cache_key": "k", "prompt_cache_options": {},
    "prompt_cache_retention": "24h", "safety_identifier": "u", "moderation": {},
    "best_of": 2, "suffix": "end",
    "spaces_between_special_tokens": False, "truncate_prompt_tokens": 8, "prompt_logprobs": 1,
    "allowed_token_ids": [5], "bad_words": ["x"], "continue_final_message": True,
    "add_special_tokens": False, "documents": [{"text": "x"}], "chat_template": "{{ 1 }}",
    "chat_template_kwargs": {"enable_thinking": False}, "mm_processor_kwargs": {},
    "media_io_kwargs": {}, "structural_tag": "{}", "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": " ", "request_id": "r1", "logits_processors": ["m.f"],
    "return_tokens_as_token_ids": True, "return_token_ids": True, "cache_salt": "s",
    "kv_transfer_params": {}, "vllm_xargs": {}, "include_reasoning": False,
    "prompt_embeds": "AAAA",
}
"""A sample value of every field walked (a field missing here fails the walk)."""

SERVER_CHECKED = {
    ChatCompletionRequest: {"model", "messages", "stream", "stream_options", "user", "timeout",
                            "priority", "echo", "add_generation_prompt",
                            "continue_final_message", "chat_template_kwargs", "tools",
                            "tool_choice", "parallel_tool_calls", "return_token_ids",
                            "return_tokens_as_token_ids", "cache_salt", "include_reasoning",
                            "request_id", "chat_template", "documents"},
    CompletionRequest: {"model", "prompt", "stream", "stream_options", "user", "timeout",
                        "priority", "echo", "return_token_ids", "add_special_tokens",
                        "return_tokens_as_token_ids", "cache_salt", "request_id"},
}
"""Declared fields that SamplingParams does not carry: each is exercised through the server
below or, for the chat template's options, a request's own template and documents, in
test_chat.py, for the tool fields and include_reasoning, in test_tool_calls.py, for
return_token_ids, add_special_tokens, return_tokens_as_token_ids, cache_salt and request_id,
in test_vllm_response_extras.py (``user``, OpenAI's end-user id for its abuse monitoring, is
accepted with no effect)."""

WALKS = [
    (ChatCompletionRequest, "/v1/chat/completions", OPENAI_CHAT | VLLM_CHAT_EXTRAS),
    (CompletionRequest, "/v1/completions", OPENAI_COMPLETIONS | VLLM_COMPLETION_EXTRAS),
]


def _base(cls: type[SamplingFields]) -> dict[str, Any]:
    return {"messages": MESSAGES} if cls is ChatCompletionRequest else {"prompt": "Hello"}


def _params(cls: type[SamplingFields], body: dict[str, Any]) -> str:
    return repr(cls.model_validate(body).to_sampling_params())


@pytest.mark.parametrize(("cls", "path", "fields"), WALKS, ids=["chat", "completions"])
def test_every_field_is_used_or_refused(cls: type[SamplingFields], path: str,
                                        fields: set[str]) -> None:
    declared = set(cls.model_fields)
    missing = sorted(f for f in fields - declared - SERVER_CHECKED[cls] if f not in SAMPLES)
    assert not missing, f"add a sample value for {missing}"
    baseline = _params(cls, _base(cls))
    for name in sorted(fields | declared):
        if name in SERVER_CHECKED[cls]:
            assert name in declared, name
        elif name in declared:
            body = {**_base(cls), name: SAMPLES[name]}
            if name == "top_logprobs":
                body["logprobs"] = True  # needs it; compared with logprobs alone
                assert _params(cls, body) != _params(cls, {**_base(cls), "logprobs": True})
            elif name == "length_penalty":
                body["use_beam_search"] = True  # needs it; compared with it alone
                beams = {**_base(cls), "use_beam_search": True}
                assert _params(cls, body) != _params(cls, beams)
            else:
                assert _params(cls, body) != baseline, f"{name} changes nothing"
        else:
            assert name in UNSUPPORTED_FIELDS, f"{name}: neither implemented nor refused"


@pytest.mark.parametrize(("cls", "path", "fields"), WALKS, ids=["chat", "completions"])
def test_every_unimplemented_field_is_a_400_naming_it(
    server: ServerProcess, model_name: str, cls: type[SamplingFields], path: str,
    fields: set[str],
) -> None:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        for name in sorted(fields - set(cls.model_fields)):
            body = {"model": model_name, **_base(cls), name: SAMPLES[name]}
            err = _refused(http.post(path, json=body), name)
            assert err["code"] == "unsupported_parameter"
            assert err["message"].startswith(f"{name} is not supported")
        err = _refused(http.post(path, json={**_base(cls), "temprature": 0.5}), "temprature")
        assert err == {"message": "temprature: unknown field", "type": "invalid_request_error",
                       "param": "temprature", "code": "unknown_parameter"}


def _refused(response: httpx.Response, param: str) -> dict[str, Any]:
    assert response.status_code == 400, (param, response.text)
    err = response.json()["error"]
    assert err["param"] == param, err
    return err


def test_nested_objects_and_messages_refuse_their_unknown_fields(server: ServerProcess) -> None:
    options = _keys(ChatCompletionStreamOptionsParam) - {"include_usage"}
    assistant = _keys(ChatCompletionAssistantMessageParam) - {"role", "content", "name",
                                                              "tool_calls"}
    assert options == {"include_obfuscation"} and assistant <= set(UNSUPPORTED_FIELDS)
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/chat/completions", {"messages": MESSAGES, "stream": True,
                                  "stream_options": {"include_obfuscation": True}},
         "stream_options.include_obfuscation"),
        ("/v1/chat/completions",
         {"messages": [{"role": "assistant", "content": "x", "function_call": {}}]},
         "messages[0].function_call"),
        ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
            "type": "json_schema", "json_schema": {"name": "n", "schema": {}, "x": 1}}},
         "response_format.json_schema.x"),
        ("/tokenize", {"prompt": "hi", "add_special": False}, "add_special"),
        ("/tokenize", {"messages": MESSAGES, "mm_processor_kwargs": {}}, "mm_processor_kwargs"),
        ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, "skip_special_tokens"),
    ]
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        for path, body, param in cases:
            err = _refused(http.post(path, json=body), param)
            assert "not supported" in err["message"] or "unknown field" in err["message"], err
        ok = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}],
                          "name": "ann"}], "max_tokens": 1})
        assert ok.status_code == 200, ok.text


def test_declared_fields_without_sampling_params_act(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        def chat(**fields: Any) -> httpx.Response:
            return http.post("/v1/chat/completions", json={"messages": MESSAGES,
                                                           "max_tokens": 2, **fields})

        def usage(r: httpx.Response) -> dict[str, Any]:
            assert r.status_code == 200, r.text
            return r.json()["usage"]

        with_prompt = usage(chat())["prompt_tokens"]
        assert usage(chat(add_generation_prompt=False))["prompt_tokens"] < with_prompt
        assert usage(chat(user="someone"))["prompt_tokens"] == with_prompt
        echoed = chat(messages=[*MESSAGES, {"role": "assistant", "content": "Sure:"}], echo=True,
                      add_generation_prompt=False)
        assert echoed.json()["choices"][0]["message"]["content"].startswith("Sure:")
        assert chat(model="other").status_code == 404
        assert chat(timeout=1e-6).status_code == 408
        err = _refused(chat(priority=1), "priority")
        assert "--policy priority" in err["message"]
        assert chat(priority=0).status_code == 200
        completion = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2,
                                                        "echo": True})
        assert completion.json()["choices"][0]["text"].startswith("Hello")
        streamed = http.post("/v1/completions", json={
            "prompt": "Hello", "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}})
        assert streamed.headers["content-type"].startswith("text/event-stream")
        assert '"usage":{"prompt_tokens"' in streamed.text.replace(" ", "")


def test_openapi_schema_forbids_undeclared_fields(server: ServerProcess) -> None:
    schemas = httpx.get(f"{server.url}/openapi.json", timeout=10).json()["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest", "ChatMessage", "StreamOptions",
                 "ResponseFormat", "TokenizeRequest", "DetokenizeRequest"):
        assert schemas[name]["additionalProperties"] is False, name
    assert "priority" in schemas["ChatCompletionRequest"]["properties"]
    assert "tool" in schemas["ChatMessage"]["properties"]["role"]["enum"]
    assert httpx.get(f"{server.url}/docs", timeout=10).status_code == 404


@pytest.mark.parametrize("cls", [ChatCompletionRequest, CompletionRequest])
def test_generation_config_defaults_fill_unset_fields(cls: type[SamplingFields]) -> None:
    """The model's generation_config.json values apply to the fields a request leaves unset;
    a field the request sets wins (vLLM's --generation-config auto)."""
    defaults = {"temperature": 0.25, "top_p": 0.5, "top_k": 7, "max_tokens": 9}
    unset = cls.model_validate(_base(cls)).to_sampling_params(defaults)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.max_tokens) == (0.25, 0.5, 7, 9)
    body = {**_base(cls), "temperature": 1.5, "max_tokens": 3}
    given = cls.model_validate(body).to_sampling_params(defaults)
    assert (given.temperature, given.top_p, given.max_tokens) == (1.5, 0.5, 3)
