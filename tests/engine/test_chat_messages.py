"""Chat input before the tokenizer: conversations, the render options, each message checked
with the field named (the renderer's tests, with a tokenizer, are in test_input_processor.py)."""

from __future__ import annotations

import pytest

from pagedserve.engine.chat_messages import (
    ChatRenderOptions,
    as_conversations,
    text_messages,
)

HELLO = [{"role": "user", "content": "hi"}]


def test_one_conversation_or_a_list_of_them() -> None:
    assert as_conversations(HELLO) == [HELLO]
    assert as_conversations([HELLO, HELLO]) == [HELLO, HELLO]


def test_text_parts_are_joined_and_none_is_an_empty_turn() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None}]  # fmt: skip
    assert [m["content"] for m in text_messages(messages)] == ["ab", ""]


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([], "messages"),
        ([{"content": "x"}], r"messages\[0\]"),
        ([{"role": 1, "content": "x"}], r"messages\[0\]\.role"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], r"messages\[0\]\.content\[0\]\.type"),
        ([{"role": "assistant", "tool_calls": "call"}], r"messages\[0\]\.tool_calls"),
    ],
)  # fmt: skip
def test_bad_messages_name_the_field(messages: list, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        text_messages(messages)


def test_tool_call_arguments_reach_the_template_as_objects() -> None:
    call = {"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    (message,) = text_messages([{"role": "assistant", "content": None, "tool_calls": [call]}])
    assert message["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    call["function"]["arguments"] = "{not json"
    with pytest.raises(ValueError, match=r"tool_calls\[0\]\.function\.arguments"):
        text_messages([{"role": "assistant", "tool_calls": [call]}])


def test_render_options_refuse_what_cannot_hold_together() -> None:
    assert ChatRenderOptions.of().add_generation_prompt is True
    assert ChatRenderOptions.of(continue_final_message=True).add_generation_prompt is False
    with pytest.raises(ValueError, match="continue_final_message"):
        ChatRenderOptions.of(add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        ChatRenderOptions.of(chat_template_kwargs={"add_generation_prompt": False})
    with pytest.raises(ValueError, match="tools"):
        ChatRenderOptions.of(tools="f")  # type: ignore[arg-type]
