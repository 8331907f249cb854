"""Tool calling end to end through the official ``openai`` client, against a server running a
tiny random model with a Qwen2.5/Hermes-style template and ``--enable-auto-tool-choice
--tool-call-parser hermes --reasoning-parser qwen3``: ``"required"`` and named choices always
give arguments valid for schemas the model knows nothing of, streams add up to the same calls,
``"auto"`` reads calls (after thinking) from the text, and what does not fit is a 400."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from pagedserve.entrypoints.cli import main
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest
from tests.entrypoints.openai.server_utils import API_KEY, ServerProcess, running_server
from tests.entrypoints.openai.tool_models import save_tool_checkpoint

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "metric": {"type": "boolean"}},
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 5}},
        "required": ["zone"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS: list[Any] = [{"type": "function", "function": {"name": name, "parameters": schema}}
                    for name, schema in SCHEMAS.items()]
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
THINK_THEN_CALL = (r"<think>Paris is in France\.</think>\n<tool_call>\n\{\"name\": "
                   r"\"get_weather\", \"arguments\": \{\"city\": \"(Paris|Rome)\", \"days\": "
                   r"[1-7], \"metric\": (true|false)\}\}\n</tool_call>")
"""An "auto" output forced through a regex: thinking, then a call in the hermes format."""


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = save_tool_checkpoint("hermes", tmp_path_factory.mktemp("hermes_model"))
    with running_server(folder, folder / "server.log", "--api-key", API_KEY,
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--reasoning-parser", "qwen3") as proc:
        yield proc


@pytest.fixture(scope="module")
def tool_client(tool_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


def _check_calls(calls: Any) -> list[tuple[str, dict]]:
    """Each call well formed, its arguments valid for its function's schema."""
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def _streamed(stream: Any) -> tuple[list[tuple[str, dict]], str, str, str | None]:
    """(calls, content, reasoning, finish reason) accumulated from a stream's deltas."""
    calls: dict[int, list[str]] = {}
    content = reasoning = ""
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                if call.id is not None:
                    calls[call.index] = [call.function.name, ""]
                calls[call.index][1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return [(n, json.loads(a)) for n, a in calls.values()], content, reasoning, finish


def test_required_choice_gives_valid_calls(tool_client: openai.OpenAI) -> None:
    """One call per completion (a random model would go on adding calls to the array until
    max_tokens): each valid; with parallel calls allowed and a short max_tokens, the calls
    finished before the cut."""
    response = tool_client.chat.completions.create(
        model="", messages=MESSAGES, tools=TOOLS, tool_choice="required", n=3,
        parallel_tool_calls=False, temperature=1.0, seed=5, max_tokens=400)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(_check_calls(choice.message.tool_calls)) == 1
    cut = tool_client.chat.completions.create(
        model="", messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0.0,
        max_tokens=60).choices[0]
    assert cut.finish_reason == "length" and len(_check_calls(cut.message.tool_calls)) >= 1


def test_named_choice_gives_valid_arguments(tool_client: openai.OpenAI) -> None:
    response = tool_client.chat.completions.create(
        model="", messages=MESSAGES, tools=TOOLS, n=3, temperature=1.0, seed=1,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=100)
    for choice in response.choices:
        assert [name for name, _ in _check_calls(choice.message.tool_calls)] == ["get_time"]


@pytest.mark.parametrize("tool_choice", ["required", "get_weather"])
def test_stream_adds_up_to_the_same_calls(tool_client: openai.OpenAI, tool_choice: str) -> None:
    choice: Any = (tool_choice if tool_choice == "required"
                   else {"type": "function", "function": {"name": tool_choice}})
    kwargs: Any = {"model": "", "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice,
                   "parallel_tool_calls": False, "temperature": 0.0, "max_tokens": 400}
    whole = tool_client.chat.completions.create(**kwargs).choices[0]
    calls, content, _, finish = _streamed(tool_client.chat.completions.create(**kwargs,
                                                                               stream=True))
    assert calls == _check_calls(whole.message.tool_calls)
    assert content == "" and finish == whole.finish_reason == "tool_calls"


def test_auto_reads_a_call_after_thinking(tool_client: openai.OpenAI) -> None:
    kwargs: Any = {"model": "", "messages": MESSAGES, "tools": TOOLS, "temperature": 0.0,
                   "max_tokens": 200, "extra_body": {"guided_regex": THINK_THEN_CALL}}
    whole = tool_client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert getattr(whole.message, "reasoning_content", None) == "Paris is in France."
    calls = _check_calls(whole.message.tool_calls)
    assert [name for name, _ in calls] == ["get_weather"]
    streamed = _streamed(tool_client.chat.completions.create(**kwargs, stream=True))
    assert streamed == (calls, "", "Paris is in France.", "tool_calls")


def test_include_reasoning_false_leaves_the_reasoning_out(tool_client: openai.OpenAI) -> None:
    kwargs: Any = {"model": "", "messages": MESSAGES, "tools": TOOLS, "temperature": 0.0,
                   "max_tokens": 200,
                   "extra_body": {"guided_regex": THINK_THEN_CALL, "include_reasoning": False}}
    whole = tool_client.chat.completions.create(**kwargs).choices[0]
    assert getattr(whole.message, "reasoning_content", None) is None
    assert [name for name, _ in _check_calls(whole.message.tool_calls)] == ["get_weather"]
    calls, content, reasoning, finish = _streamed(
        tool_client.chat.completions.create(**kwargs, stream=True))
    assert (reasoning, content, finish) == ("", "", "tool_calls")
    assert calls == _check_calls(whole.message.tool_calls)


def test_a_conversation_with_a_tool_result_is_answered(tool_client: openai.OpenAI) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages: Any = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    response = tool_client.chat.completions.create(
        model="", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4)
    message = response.choices[0].message
    assert message.tool_calls == [] and message.content
    assert response.usage and response.usage.prompt_tokens > 100  # the tools were rendered


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name"),
    ({"messages": [*MESSAGES, {"role": "tool", "content": "x"}]}, "messages[1]"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_requests_are_a_400_naming_the_field(
    tool_server: ServerProcess, body: dict, param: str
) -> None:
    r = httpx.post(f"{tool_server.url}/v1/chat/completions", headers=AUTH, timeout=30,
                   json={"messages": MESSAGES, "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_auto_needs_the_server_flag(server: ServerProcess) -> None:
    """The shared server runs without --enable-auto-tool-choice: tools without a tool_choice
    mean "auto", refused; "required" needs no parser."""
    def post(**fields: Any) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, timeout=60,
                          json={"messages": MESSAGES, "max_tokens": 64, "tools": TOOLS,
                                **fields})

    refused = post()
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in refused.json()["error"]["message"]
    named = post(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.status_code == 200, named.text
    (call,) = named.json()["choices"][0]["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)


def test_serve_refuses_auto_without_a_parser(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--enable-auto-tool-choice"]) != 0
    assert "needs --tool-call-parser" in capsys.readouterr().err


def test_auto_keeps_special_tokens_unless_the_request_says() -> None:
    """Some models' call markup (Mistral's [TOOL_CALLS], Llama's <|python_tag|>) is a special
    token: "auto" keeps them in the text the parser reads."""
    def params(**fields: Any) -> Any:
        body = {"messages": MESSAGES, "tools": TOOLS, **fields}
        return ChatCompletionRequest.model_validate(body).to_sampling_params()

    assert params().skip_special_tokens is False
    assert params(skip_special_tokens=True).skip_special_tokens is True
    assert params(tool_choice="required").skip_special_tokens is True
    assert params(tool_choice="required").structured_outputs.kind == "json"
