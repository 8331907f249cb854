"""Tool calling with the default model (SmolLM2-135M-Instruct, a ChatML model) served with a
Hermes-style chat template that shows it the tools: a named choice through the ``openai``
client, and an OpenAI Agents SDK run that calls a function tool (``tool_choice="required"`` on
its first turn) and answers from the tool's result."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

from pagedserve.config import DEFAULT_MODEL
from tests.entrypoints.openai.server_utils import API_KEY, ServerProcess, running_server
from tests.entrypoints.openai.tool_models import HERMES

FORECAST = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def smol_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("smol_server") / "server.log"
    with running_server(Path(DEFAULT_MODEL), log, "--api-key", API_KEY, "--chat-template",
                        HERMES, "--enable-auto-tool-choice", "--tool-call-parser",
                        "hermes") as proc:
        yield proc


def test_named_choice_with_the_default_model(smol_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key=API_KEY, max_retries=0,
                           timeout=120)
    tools: Any = [{"type": "function", "function": {
        "name": "forecast", "description": "The weather forecast.", "parameters": FORECAST}}]
    response = client.chat.completions.create(
        model=DEFAULT_MODEL, tools=tools, temperature=0.0, max_tokens=40,
        messages=[{"role": "user", "content": "Forecast for Rome, 3 days?"}],
        tool_choice={"type": "function", "function": {"name": "forecast"}})
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "forecast"
    jsonschema.validate(json.loads(call.function.arguments), FORECAST)


def test_agents_sdk_run_calls_the_tool_and_uses_its_result(smol_server: ServerProcess) -> None:
    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"It is 21 degrees and sunny in {city}."

    client = openai.AsyncOpenAI(base_url=f"{smol_server.url}/v1", api_key=API_KEY,
                                max_retries=0, timeout=120)
    agent = Agent(
        name="weather", instructions="Answer with the weather tool's result.",
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model=DEFAULT_MODEL, openai_client=client),
        model_settings=ModelSettings(tool_choice="required", temperature=0.0, max_tokens=32))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    assert len(cities) >= 1
    outputs = [item for item in result.to_input_list()
               if isinstance(item, dict) and item.get("type") == "function_call_output"]
    assert "21 degrees" in str(outputs[0]["output"])
    assert isinstance(result.final_output, str) and result.final_output
