"""User input -> engine requests: validate sampling parameters, tokenize, apply the chat template.

A prompt is a string, a list of token ids, or a dict like vLLM's ``TokensPrompt`` /
``TextPrompt`` (``{"prompt_token_ids": [...]}`` or ``{"prompt": "..."}``, optionally both).
A request with ``n > 1`` becomes ``n`` child ``Request`` objects (ids ``f"{i}_{parent_id}"``)
that the scheduler runs independently; their identical prompts share KV blocks through the
prefix cache. The output processor folds them back into one ``RequestOutput``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2

from pagedserve.core.request import Request
from pagedserve.field_types import token_id_list
from pagedserve.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]
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
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None

    @classmethod
    def of(
        cls,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
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
        return cls(generation_prompt, continue_final_message, dict(kwargs), tools)


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
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template: not a valid Jinja template: {e}") from None
    return text


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


TEXT_LENGTH_SLACK = 4
"""How many characters of user text one character of a token's vocabulary entry may stand for
in the cheap length bound (a normalizer may compose characters)."""
_CONTENT_MARK = "\x00pagedserve-content-{}\x00"
_CONTENT_MARK_RE = re.compile("\x00pagedserve-content-(\\d+)\x00")


@dataclass
class ProcessedRequest:
    """One user request, ready for the engine core (``requests``) and the output processor."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    """The resolved parameters of the request (``max_tokens`` filled, extra EOS ids added)."""
    requests: list[Request]
    """The ``n`` children, in completion-index order; ``n == 1``: one request with ``request_id``."""
    arrival_time: float


def check_unicode(field: str, text: str) -> None:
    """Refuse a string that is not valid Unicode: a lone surrogate, which JSON's ``\\ud800``
    escape can carry and no tokenizer can encode."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{field}: not valid Unicode: a lone surrogate ({text[e.start]!r}) at character "
            f"{e.start}"
        ) from None


def child_request_id(index: int, parent_id: str) -> str:
    return f"{index}_{parent_id}"


def generation_config_eos_ids(model_path: Path) -> list[int]:
    """EOS ids listed in a Hugging Face folder's ``generation_config.json`` (Llama 3 lists
    several); empty when the file is absent (GGUF models)."""
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else [int(e) for e in eos]


class InputProcessor:
    """Turns prompts and ``SamplingParams`` into ``Request`` objects the engine core accepts.

    ``eos_token_id`` is the model's primary EOS (the scheduler stops on it unless
    ``ignore_eos``); ``extra_eos_token_ids`` (e.g. Llama 3's ``<|eot_id|>``) are added to each
    request's ``stop_token_ids`` unless ``ignore_eos``.

    Chat message content is text: a control token written in it (``<|im_end|>``) is tokenized
    as plain text, so a user cannot forge the template's turns; ``parse_special_tokens_in_content``
    restores the older behaviour (the whole rendered conversation parsed for control tokens).
    ``chat_template`` (Jinja text) replaces the tokenizer's own template.
    """

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        vocab_size: int,
        eos_token_id: int | None,
        extra_eos_token_ids: Sequence[int] = (),
        parse_special_tokens_in_content: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.extra_eos_token_ids = [t for t in extra_eos_token_ids if t != eos_token_id]
        self.parse_special_tokens_in_content = parse_special_tokens_in_content
        vocab = {} if tokenizer is None else tokenizer.get_vocab()
        self.control_tokens = [] if tokenizer is None else list(tokenizer.get_added_vocab())
        """Strings the tokenizer turns into one added token wherever they appear in text."""
        self.max_text_chars = (
            TEXT_LENGTH_SLACK * max_model_len * max(map(len, vocab), default=1)
        )
        """Text longer than this cannot fit in ``max_model_len`` tokens: refused untokenized."""

    @classmethod
    def for_model(
        cls,
        tokenizer: Any,
        model_path: Path,
        max_model_len: int,
        vocab_size: int,
        parse_special_tokens_in_content: bool = False,
        chat_template: str | None = None,
    ) -> InputProcessor:
        """EOS from the tokenizer, extra EOS ids from the folder's generation config.
        ``tokenizer`` None (``skip_tokenizer_init``): token-id prompts only, no text.
        ``chat_template``: ``--chat-template`` (a file or inline Jinja), or None."""
        gen_eos = generation_config_eos_ids(model_path)
        eos = None if tokenizer is None else tokenizer.eos_token_id
        if eos is None and gen_eos:
            eos = gen_eos[0]
        template = None if chat_template is None else load_chat_template(chat_template)
        return cls(tokenizer, max_model_len, vocab_size, eos, gen_eos,
                   parse_special_tokens_in_content, template)

    # -- prompts -------------------------------------------------------------------------------

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids)."""
        if isinstance(prompt, str):
            return prompt, self.encode("prompt", prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = token_id_list("prompt_token_ids", prompt["prompt_token_ids"])
                return prompt.get("prompt"), ids
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError("prompt: a dict prompt needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, (list, tuple)):
            return None, token_id_list("prompt", prompt)
        raise ValueError(
            f"prompt: expected a string, a list of token ids or a dict, got {type(prompt).__name__}"
        )

    def encode(self, field: str, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text`` (the user's ``field``), checked first by ``check_text``."""
        tokenizer = self._require_tokenizer(field)
        self.check_text(field, text)
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def check_text(self, field: str, text: str) -> None:
        """Refuse, before any tokenizing, text that is not valid Unicode or longer than any
        prompt of ``max_model_len`` tokens can be (a cheap bound: characters against the
        longest vocabulary entry)."""
        check_unicode(field, text)
        if len(text) > self.max_text_chars:
            raise ValueError(
                f"{field}: {len(text)} characters is more than a prompt of max_model_len="
                f"{self.max_model_len} tokens can hold (at most {self.max_text_chars})"
            )

    def _require_tokenizer(self, field: str) -> Any:
        if self.tokenizer is None:
            raise ValueError(f"{field}: text needs a tokenizer, and the engine runs without one")
        return self.tokenizer

    def render_chat(
        self, messages: ChatMessages, options: ChatRenderOptions | None = None
    ) -> dict[str, Any]:
        """Apply the chat template; returns a ``{"prompt", "prompt_token_ids"}`` prompt.

        The template writes its own special tokens (BOS included), so the rendered text is
        tokenized without adding any.
        """
        options = ChatRenderOptions() if options is None else options
        messages = self._text_messages(messages)
        tokenizer = self._require_tokenizer("messages")
        if self.chat_template is None and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("messages: the model's tokenizer has no chat template "
                             "(give one with --chat-template)")
        for i, message in enumerate(messages):
            self.check_text(f"messages[{i}].content", message["content"])
        text = self._apply_template(messages, options)
        self.check_text("messages", text)
        if self.parse_special_tokens_in_content or not self._has_control_tokens(messages):
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = self._encode_content_as_text(messages, options, text)
        return {"prompt": text, "prompt_token_ids": list(ids)}

    @staticmethod
    def _text_messages(messages: ChatMessages) -> ChatMessages:
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

    def _apply_template(self, messages: ChatMessages, options: ChatRenderOptions) -> str:
        """The rendered conversation; a template that refuses it (Llama 2's and Mistral's
        refuse a system turn or roles that do not alternate) gives a ValueError with its
        message. ``continue_final_message`` cuts the text after the last message's content,
        as transformers does; a template that alters that content cannot be continued."""
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message,
                tools=options.tools,
                **options.chat_template_kwargs,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"messages: the model's chat template refused them: {e}") from None
        except ValueError as e:
            if options.continue_final_message:
                raise ValueError(f"continue_final_message: {e}") from None
            raise

    def _has_control_tokens(self, messages: ChatMessages) -> bool:
        return any(t in m["content"] for m in messages for t in self.control_tokens)

    def _encode_content_as_text(
        self, messages: ChatMessages, options: ChatRenderOptions, text: str
    ) -> list[int]:
        """Tokenize ``text`` (the rendered ``messages``) with control tokens parsed in the
        template's own text only: the template is rendered again with a marker for each
        message's content, and the content between the template's pieces is tokenized with
        its control tokens split into ordinary text tokens."""
        marked = [{**m, "content": _CONTENT_MARK.format(i)} for i, m in enumerate(messages)]
        pieces = _CONTENT_MARK_RE.split(self._apply_template(marked, options))
        # split() alternates: template text, content index, template text, ...
        contents = [messages[int(i)]["content"] for i in pieces[1::2]]
        if "".join(p if k % 2 == 0 else contents[k // 2] for k, p in enumerate(pieces)) != text:
            raise ValueError(
                "messages: a message's content holds a control token of the tokenizer "
                f"(one of {self.control_tokens[:5]}), and the chat template transforms the "
                "content, so it cannot be kept apart from the template's own control tokens"
            )
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                ids += self.tokenizer.encode(piece, add_special_tokens=False)
            else:
                ids += self.tokenizer.encode(
                    contents[k // 2], add_special_tokens=False, split_special_tokens=True
                )
        return ids

    # -- validation ----------------------------------------------------------------------------

    def _check_token_ids(self, field: str, token_ids: Sequence[int]) -> None:
        """Raise naming ``field`` and the first id outside the vocabulary. min and max run in
        C; the loop that finds the id runs only for a bad prompt."""
        if not token_ids or (min(token_ids) >= 0 and max(token_ids) < self.vocab_size):
            return
        bad = next(t for t in token_ids if not 0 <= t < self.vocab_size)
        raise ValueError(
            f"{field}: token id {bad} is outside the vocabulary (size {self.vocab_size})"
        )

    def _resolve_max_tokens(self, params: SamplingParams, num_prompt_tokens: int) -> int:
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise ValueError(
                f"prompt: the prompt has {num_prompt_tokens} tokens, but max_model_len is "
                f"{self.max_model_len} (it must leave room for at least one output token)"
            )
        if params.max_tokens is None:
            if params.min_tokens > room:
                raise ValueError(
                    f"min_tokens: {params.min_tokens} exceeds the {room} tokens left in the "
                    f"context (max_model_len {self.max_model_len})"
                )
            return room
        if params.max_tokens > room:
            raise ValueError(
                f"max_tokens: prompt ({num_prompt_tokens} tokens) + max_tokens "
                f"({params.max_tokens}) exceeds max_model_len ({self.max_model_len})"
            )
        return params.max_tokens

    def resolve_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """Validate ``params`` against the model; return a copy with ``max_tokens`` filled and
        the model's extra EOS ids in ``stop_token_ids`` (the caller's object is not changed)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling_params: expected SamplingParams, got {type(params).__name__}"
            )
        self._check_token_ids("stop_token_ids", params.stop_token_ids)
        self._check_token_ids("logit_bias", list(params.logit_bias or {}))
        if params.stop and not params.detokenize:
            raise ValueError("stop: stop strings need detokenize=True")
        if params.stop:
            self._require_tokenizer("stop")
        resolved = params.clone()
        resolved.max_tokens = self._resolve_max_tokens(params, num_prompt_tokens)
        if not params.ignore_eos:
            extra = [t for t in self.extra_eos_token_ids if t not in resolved.stop_token_ids]
            resolved.stop_token_ids = resolved.stop_token_ids + extra
        return resolved

    # -- requests ------------------------------------------------------------------------------

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> ProcessedRequest:
        """Validate and tokenize one request and fan it out into its ``n`` children.

        Raises ``ValueError`` naming the field (prompt, max_tokens, stop_token_ids, ...).
        """
        text, prompt_token_ids = self.tokenize(prompt)
        if not prompt_token_ids:
            raise ValueError("prompt: the prompt is empty (it has no tokens)")
        self._check_token_ids("prompt_token_ids", prompt_token_ids)
        resolved = self.resolve_params(params, len(prompt_token_ids))
        max_tokens = resolved.max_tokens
        assert max_tokens is not None  # resolve_params fills it
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        requests = [
            Request(
                request_id if resolved.n == 1 else child_request_id(i, request_id),
                prompt_token_ids,
                self._child_params(resolved, i),
                self.eos_token_id,
                max_tokens,
                arrival_time=arrival_time,
                priority=priority,
            )
            for i in range(resolved.n)
        ]
        return ProcessedRequest(
            request_id, text, prompt_token_ids, resolved, requests, arrival_time
        )

    @staticmethod
    def _child_params(params: SamplingParams, index: int) -> SamplingParams:
        """Each child samples one completion; a seeded request's child ``i`` uses ``seed + i``
        (wrapped into the valid range [0, 2**63)) so the ``n`` completions differ but are
        reproducible."""
        if params.n == 1:
            return params
        child = params.clone()
        child.n = 1
        if params.seed is not None:
            child.seed = (params.seed + index) % 2**63
        return child
