"""Chat input before it meets a tokenizer: conversations, how one is rendered
(``ChatRenderOptions``), the ``--chat-template`` text, and each message checked with its
content as one string and its tool calls as templates read them (vLLM's ``LLM.chat`` and
server fields, refused with the field named where they do not fit).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2

ChatMessages = list[dict[str, Any]]

if TYPE_CHECKING:
    from typing_extensions import TypeIs


def _is_conversation(messages: ChatMessages | Sequence[ChatMessages]) -> TypeIs[ChatMessages]:
    return isinstance(messages[0], dict)


def as_conversations(messages: ChatMessages | Sequence[ChatMessages]) -> Sequence[ChatMessages]:
    """Non-empty chat input as a list of conversations: ``messages`` is one conversation (its
    items are message dicts) or already a list of them."""
    return [messages] if _is_conversation(messages) else messages


CHAT_TEMPLATE_PARAMS = frozenset(
    ("conversation", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length",
     "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")
)
"""``apply_chat_template``'s own parameters: not template variables of ``chat_template_kwargs``."""


@dataclass(frozen=True)
class ChatRenderOptions:
    """How a conversation is rendered (the chat fields of vLLM's ``LLM.chat`` and server).

    ``continue_final_message``: the reply continues the last message (an assistant prefix)
    instead of starting a new turn, so no generation prompt is added after it.
    ``chat_template_kwargs``: extra template variables (Qwen3's ``enable_thinking``).
    ``tools``: function definitions in OpenAI's shape (``{"type": "function", "function":
    {...}}``), given to the template as transformers' ``apply_chat_template(tools=...)`` does.
    ``chat_template``: Jinja text rendering this conversation instead of the engine's template.
    ``documents``: retrieved texts (``{"title": ..., "text": ...}``) for templates that render
    them (RAG), given as transformers' ``apply_chat_template(documents=...)`` does.
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    documents: list[dict[str, str]] | None = None

    @classmethod
    def of(
        cls,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        documents: list[dict[str, str]] | None = None,
    ) -> ChatRenderOptions:
        """``add_generation_prompt`` None: True unless ``continue_final_message``; both True is
        refused (the reply cannot both continue the last turn and start a new one)."""
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "continue_final_message: cannot be combined with add_generation_prompt=true "
                "(set add_generation_prompt to false)"
            )
        kwargs = {} if chat_template_kwargs is None else chat_template_kwargs
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise ValueError("chat_template_kwargs: expected a dict with string keys")
        reserved = sorted(CHAT_TEMPLATE_PARAMS.intersection(kwargs))
        if reserved:
            raise ValueError(
                f"chat_template_kwargs: {reserved[0]!r} is a parameter of the chat template "
                "call, not a template variable (use the request field of that name)"
            )
        generation_prompt = (
            not continue_final_message if add_generation_prompt is None else add_generation_prompt
        )
        if tools is not None and not (
            isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
        ):
            raise ValueError("tools: expected a list of function definitions (dicts)")
        if chat_template is not None:
            check_template_syntax(chat_template)
        if documents is not None and not (isinstance(documents, list) and all(
                isinstance(d, dict) and all(isinstance(v, str) for v in d.values())
                for d in documents)):
            raise ValueError("documents: expected a list of dicts of strings "
                             "({'title': ..., 'text': ...})")
        return cls(generation_prompt, continue_final_message, dict(kwargs), tools, chat_template,
                   documents)


def load_chat_template(value: str) -> str:
    """The Jinja text of ``--chat-template``: a file's contents, or ``value`` itself when it is
    an inline template (as vLLM: a value holding ``{``, ``}`` or a newline is a template).
    Syntax errors are refused here, at start-up, rather than at the first chat request."""
    path = Path(value)
    if any(c in value for c in "{}\n"):
        text = value
    elif path.is_file():
        text = path.read_text()
    else:
        raise ValueError(
            f"chat_template: {value!r} is neither a readable file nor an inline Jinja template"
        )
    check_template_syntax(text)
    return text


def check_template_syntax(text: str) -> None:
    if not isinstance(text, str) or not text.strip():
        raise ValueError("chat_template: expected the text of a Jinja template")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template: not a valid Jinja template: {e}") from None


def message_text(index: int, content: Any) -> str:
    """A message's content as text: a string, None (an empty turn), or a list of parts of
    which only ``{"type": "text", "text": ...}`` is supported (joined, as the server does)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(
            f"messages[{index}].content: expected a string or a list of "
            "{'type': 'text', 'text': ...} parts"
        )
    texts = []
    for j, part in enumerate(content):
        where = f"messages[{index}].content[{j}]"
        if not isinstance(part, dict) or "type" not in part:
            raise ValueError(f"{where}: expected a dict with 'type'")
        if part["type"] != "text":
            raise ValueError(f"{where}.type: {part['type']!r} is not supported (only 'text')")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}.text: expected a string")
        texts.append(part["text"])
    return "".join(texts)


def template_tool_calls(index: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as chat templates read them: each call's
    ``function.arguments`` as an object, not JSON text (as vLLM passes them)."""
    if not isinstance(calls, list):
        raise ValueError(f"messages[{index}].tool_calls: expected a list")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise ValueError(f"messages[{index}].tool_calls[{j}]: expected a dict with "
                             "'function'")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise ValueError(f"messages[{index}].tool_calls[{j}].function.arguments: not "
                                 "valid JSON") from None
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def text_messages(messages: ChatMessages) -> ChatMessages:
    """``messages`` checked, each message's content as one string (text parts joined)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: expected a non-empty list of {'role', 'content'} dicts")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or (
            "content" not in message and "tool_calls" not in message
        ):
            raise ValueError(f"messages[{i}]: expected a dict with 'role' and 'content' "
                             "(or 'tool_calls')")
        if not isinstance(message["role"], str):
            raise ValueError(f"messages[{i}].role: must be a string")
        out.append({**message, "content": message_text(i, message.get("content"))})
        if message.get("tool_calls"):
            out[-1]["tool_calls"] = template_tool_calls(i, message["tool_calls"])
    return out
