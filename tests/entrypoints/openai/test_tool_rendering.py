"""A two-turn tool conversation (a call, its result, the answer) rendered through the chat
templates of three model families exactly as transformers' ``apply_chat_template(messages,
tools=...)`` renders it: from a server request body, and through ``LLM.chat``."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.input_processor import InputProcessor
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest
from tests.entrypoints.openai.tool_models import STYLES, save_tool_checkpoint, tool_tokenizer

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
CALL_ID = "aB3dE6gH9"  # Mistral's templates want 9 letters and digits
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": CALL_ID, "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": '{"celsius": 21}'},
    {"role": "assistant", "content": "21 degrees."},
    {"role": "user", "content": "And the time?"},
]


def transformers_messages() -> list[dict[str, Any]]:
    """The conversation as a transformers user writes it: arguments as objects."""
    messages = copy.deepcopy(CONVERSATION)
    for message in messages:
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        if message["content"] is None:
            message["content"] = ""
    return messages


def expected(style: str) -> str:
    return tool_tokenizer(style).apply_chat_template(
        transformers_messages(), tools=TOOLS, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("style", sorted(STYLES))
def test_server_request_renders_as_transformers(style: str) -> None:
    tokenizer = tool_tokenizer(style)
    request = ChatCompletionRequest.model_validate(
        {"messages": CONVERSATION, "tools": TOOLS, "tool_choice": "auto"})
    processor = InputProcessor(tokenizer, 4096, len(tokenizer), tokenizer.eos_token_id)
    rendered = processor.render_chat(request.chat_dicts(), request.chat_options())
    text = expected(style)
    assert rendered["prompt"] == text
    assert '"city": "Paris"' in text and "get_time" in text and "21" in text
    assert rendered["prompt_token_ids"] == tokenizer.encode(text, add_special_tokens=False)


def test_offline_chat_renders_tools_as_the_server(tmp_path: Path) -> None:
    folder = save_tool_checkpoint("hermes", tmp_path)
    llm = LLM(model=str(folder), dtype="float32", max_model_len=1024,
              num_gpu_blocks_override=80)
    (output,) = llm.chat(CONVERSATION, SamplingParams(max_tokens=1), use_tqdm=False,
                         tools=TOOLS)
    assert output.prompt == expected("hermes")
    with pytest.raises(ValueError, match=r"messages\[2\].tool_calls\[0\].function.arguments"):
        broken = copy.deepcopy(CONVERSATION)
        broken[2]["tool_calls"][0]["function"]["arguments"] = "{city"
        llm.chat(broken, SamplingParams(max_tokens=1), use_tqdm=False, tools=TOOLS)
