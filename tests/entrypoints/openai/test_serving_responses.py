"""``/v1/responses`` through the official ``openai`` client: the same tokens as the chat
completion it translates to, input items (instructions, text parts, function calls and their
outputs), function tools, the stream of typed events, and the refusals."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from pagedserve.entrypoints.openai.responses_protocol import ResponsesRequest
from tests.entrypoints.openai.server_utils import API_KEY, ServerProcess
from tests.reliability.reliability_utils import wait_idle

USER = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                          "required": ["city"]}}
"""Its one argument is an enum, so a forced call is short even from a random model."""


def _chat(client: openai.OpenAI, model: str, messages: list[dict[str, Any]], n: int):
    return client.chat.completions.create(model=model, messages=messages, temperature=0.0,
                                          max_completion_tokens=n)


def test_text_in_text_out_equals_the_chat_completion(
    client: openai.OpenAI, model_name: str
) -> None:
    response = client.responses.create(model=model_name, input=USER, instructions="Be terse.",
                                       max_output_tokens=8, temperature=0.0)
    chat = _chat(client, model_name, [{"role": "system", "content": "Be terse."},
                                      {"role": "user", "content": USER}], 8)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == 8
    finished = chat.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if finished else "completed")
    assert response.instructions == "Be terse." and response.store is False


def test_function_call_items_render_as_tool_turns(client: openai.OpenAI, model_name: str) -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    response = client.responses.create(model=model_name, input=items, tools=[WEATHER],
                                       tool_choice="none", max_output_tokens=4, temperature=0.0)
    tool_call = {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    chat = client.chat.completions.create(
        model=model_name, temperature=0.0, max_completion_tokens=4, tool_choice="none",
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                 if k != "type"}}],
        messages=[{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "", "tool_calls": [tool_call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content


def test_a_required_tool_is_a_function_call_item(client: openai.OpenAI, model_name: str) -> None:
    response = client.responses.create(model=model_name, input="Weather in Paris?",
                                       tools=[WEATHER], tool_choice="required",
                                       max_output_tokens=60, temperature=0.0)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")


def test_the_stream_of_events(client: openai.OpenAI, model_name: str) -> None:
    full = client.responses.create(model=model_name, input=USER, max_output_tokens=6,
                                   temperature=0.0)
    events = list(client.responses.create(model=model_name, input=USER, max_output_tokens=6,
                                          temperature=0.0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{full.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 6


def test_a_streamed_function_call(client: openai.OpenAI, model_name: str) -> None:
    events = list(client.responses.create(model=model_name, input="Weather in Paris?",
                                          tools=[WEATHER], tool_choice="required",
                                          max_output_tokens=60, temperature=0.0, stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert any(item.type == "function_call" and item.name == "get_weather" for item in added)
    arguments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and done[0].arguments == arguments
    assert json.loads(arguments)["city"] in ("Paris", "Rome")


@pytest.mark.parametrize("fields, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
])
def test_refusals_name_the_field(client: openai.OpenAI, model_name: str,
                                 fields: dict[str, Any], param: str) -> None:
    body = {"input": "Hi", **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model_name, **body)
    assert caught.value.body["param"] == param, caught.value.body


def test_text_format_and_tool_choice_translate_to_chat_fields() -> None:
    request = ResponsesRequest.model_validate({
        "input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "w"},
        "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"},
                            "strict": True}}, "stream": True})
    body = request.chat_body()
    assert body["tool_choice"] == {"type": "function", "function": {"name": "w"}}
    assert body["tools"][0] == {"type": "function", "function": {
        k: v for k, v in WEATHER.items() if k != "type"}}
    assert body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object"}, "strict": True}}
    assert body["stream_options"] == {"include_usage": True}


def test_a_client_leaving_a_stream_aborts_its_request(server: ServerProcess,
                                                       model_name: str) -> None:
    body = {"model": model_name, "input": USER, "max_output_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        for line in response.iter_lines():
            if "response.output_text.delta" in line:
                break  # the request runs; leave
    wait_idle(server.url, timeout=10.0)
