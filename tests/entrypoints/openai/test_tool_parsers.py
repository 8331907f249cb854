"""Tool-call and reasoning parsers on fixed model outputs: the whole output, and the same
output streamed in every piece size down to one character, whose deltas must add up to the
whole output's result with no markup in the content."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pagedserve.entrypoints.openai.chat_output import ChoiceParser, ChoiceStream, ParsedChoice
from pagedserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from pagedserve.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedserve.entrypoints.openai.tool_parsers.forced import (
    NamedFunctionOutput,
    RequiredCallsOutput,
)

WEATHER = '{"city": "Paris", "unit": "celsius"}'
TIME = r'{"zone": "CET \"x\" \\", "nested": {"list": [1, "}]", {"a": null}]}}'

HERMES_TWO = (f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n'
              f'</tool_call>\n<tool_call>\n{{"name": "get_time", "arguments": {TIME}}}\n'
              "</tool_call>")
LLAMA_TWO = (f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}; '
             f'{{"name": "get_time", "parameters": {TIME}}}')
MISTRAL_TWO = (f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER}}}, '
               f'{{"name": "get_time", "arguments": {TIME}}}]')
TWO_CALLS = [("get_weather", WEATHER), ("get_time", TIME)]


def _calls(parsed: ParsedChoice) -> list[tuple[str | None, str]]:
    return [(c.name, c.arguments) for c in parsed.calls]


def _stream(parser: ChoiceParser, text: str, size: int) -> dict[str, Any]:
    """The deltas of ``text`` fed in pieces of ``size`` characters, accumulated the way a
    client does."""
    stream = ChoiceStream(parser, lambda: "call_x")
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    deltas = [stream.update(p) for p in pieces[:-1]] + [stream.finish(pieces[-1])]
    out: dict[str, Any] = {"reasoning": "", "content": "", "calls": []}
    for delta in filter(None, deltas):
        out["reasoning"] += delta.reasoning_content or ""
        out["content"] += delta.content or ""
        for call in delta.tool_calls or []:
            if call.index == len(out["calls"]):
                assert call.id and call.type == "function" and call.function.name
                assert call.function.arguments == ""
                out["calls"].append([call.function.name, ""])
            else:
                assert call.id is None and call.function.name is None
                out["calls"][call.index][1] += call.function.arguments
    out["calls"] = [tuple(c) for c in out["calls"]]
    return out


def _check_streams(parser: ChoiceParser, text: str) -> None:
    whole = parser.parse(text)
    for size in (1, 2, 3, 7, len(text) or 1):
        streamed = _stream(parser, text, size)
        assert streamed["calls"] == _calls(whole), size
        assert streamed["content"] == (whole.content or ""), size
        assert streamed["reasoning"] == (whole.reasoning or ""), size


@pytest.mark.parametrize(("name", "text", "content"), [
    ("hermes", HERMES_TWO, "Let me check.\n"),
    ("llama3_json", LLAMA_TWO, None),
    ("mistral", MISTRAL_TWO, None),
])
def test_two_calls_whole_and_streamed(name: str, text: str, content: str | None) -> None:
    parser = ChoiceParser(TOOL_PARSERS[name](), None, None)
    whole = parser.parse(text)
    assert _calls(whole) == TWO_CALLS and whole.content == content
    assert all(json.loads(args) for _, args in _calls(whole))
    _check_streams(parser, text)
    assert _calls(ChoiceParser(TOOL_PARSERS[name](), None, 1).parse(text)) == TWO_CALLS[:1]


@pytest.mark.parametrize(("name", "text"), [
    ("hermes", 'Sure <tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'),
    ("hermes", "<tool_call>not json</tool_call>"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}} and more'),
    ("llama3_json", '{"name": "f", "parameters": {"a": '),
    ("mistral", '[TOOL_CALLS] {"name": "f"}'),
    ("mistral", '[TOOL_CALLS] [{"name": 3, "arguments": {}}]'),
])
def test_malformed_calls_are_content(name: str, text: str) -> None:
    parser = ChoiceParser(TOOL_PARSERS[name](), None, None)
    whole = parser.parse(text)
    assert whole.calls == [] and whole.content == text
    assert _stream(parser, text, 1)["content"] == text


@pytest.mark.parametrize(("name", "text"), [
    ("hermes", "The weather is <b>nice</b> < tool_call> <tool_"),
    ("llama3_json", "The answer is {not a call}"),
    ("mistral", "Plain [TOOL answer [TOOL_CALL"),
])
def test_plain_text_is_content_and_markup_prefixes_are_held_then_released(
    name: str, text: str
) -> None:
    parser = ChoiceParser(TOOL_PARSERS[name](), None, None)
    assert parser.parse(text) == ParsedChoice(None, text, [])
    _check_streams(parser, text)


def test_markup_never_reaches_content_deltas() -> None:
    parser = ChoiceParser(TOOL_PARSERS["hermes"](), None, None)
    stream = ChoiceStream(parser, lambda: "id")
    contents = [d.content for d in map(stream.update, HERMES_TWO) if d and d.content]
    assert "".join(contents) == "Let me check.\n"


def test_mistral_ids_are_nine_alphanumerics() -> None:
    ids = {TOOL_PARSERS["mistral"]().new_call_id() for _ in range(20)}
    assert len(ids) == 20 and all(len(i) == 9 and i.isalnum() for i in ids)


@pytest.mark.parametrize(("name", "text", "reasoning", "rest"), [
    ("qwen3", "<think>\nHmm, 2 < 3.\n</think>\n\nYes.", "\nHmm, 2 < 3.\n", "Yes."),
    ("qwen3", "No thinking here.", None, "No thinking here."),
    ("qwen3", "<think>cut off", "cut off", ""),
    ("deepseek_r1", "Hmm.</think>Yes.", "Hmm.", "Yes."),
    ("deepseek_r1", "<think>Hmm.</think> Yes.", "Hmm.", "Yes."),
    ("deepseek_r1", "all thinking", "all thinking", ""),
])
def test_reasoning_split(name: str, text: str, reasoning: str | None, rest: str) -> None:
    parser = ChoiceParser(None, REASONING_PARSERS[name](), None)
    assert parser.parse(text) == ParsedChoice(reasoning, rest, [])
    _check_streams(parser, text)


def test_tool_call_after_thinking() -> None:
    text = "<think>I should call get_weather.</think>\n" + HERMES_TWO
    parser = ChoiceParser(TOOL_PARSERS["hermes"](), REASONING_PARSERS["qwen3"](), None)
    whole = parser.parse(text)
    assert whole.reasoning == "I should call get_weather."
    assert _calls(whole) == TWO_CALLS and whole.content == "Let me check.\n"
    _check_streams(parser, text)


def test_constrained_outputs() -> None:
    named = ChoiceParser(NamedFunctionOutput("get_weather"), None, 1)
    assert _calls(named.parse(WEATHER)) == [("get_weather", WEATHER)]
    _check_streams(named, WEATHER)
    required = ChoiceParser(RequiredCallsOutput(), None, None)
    text = f'[{{"name": "get_weather", "parameters": {WEATHER}}}, {{"name": "get_time", ' \
           f'"parameters": {TIME}}}]'
    assert _calls(required.parse(text)) == TWO_CALLS
    _check_streams(required, text)
