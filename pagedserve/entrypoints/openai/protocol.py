"""Request bodies of the OpenAI-compatible API (pydantic), and their mapping to SamplingParams.

The field constraints mirror ``SamplingParams.validate`` so that a bad value is refused by
pydantic with the field's name, and so that ``/openapi.json`` states what the server accepts.
vLLM's extra sampling fields (top_k, min_p, repetition_penalty, ...) are accepted on both APIs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, Strict, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pagedserve.beam_search import MAX_BEAM_WIDTH, BeamSearchParams
from pagedserve.engine.chat_messages import ChatRenderOptions
from pagedserve.engine.input_processor import check_unicode
from pagedserve.entrypoints.openai.openapi_schema import TOKEN_ID_DESCRIPTION
from pagedserve.entrypoints.openai.structured_outputs import StructuredOutputFields
from pagedserve.entrypoints.openai.tools_protocol import ChatTool, MessageToolCall, ToolFields
from pagedserve.entrypoints.openai.unsupported_fields import RequestBody
from pagedserve.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_TEMPERATURE,
    SamplingParams,
)
from pagedserve.structured_output.params import StructuredOutputsParams

MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP = 64
MAX_REQUEST_ID_CHARS = 512
MAX_CHAT_TEMPLATE_CHARS = 65536
MAX_DOCUMENTS = 256

NULL_MEANS_DEFAULT = frozenset({
    "n", "stream", "echo", "min_tokens", "ignore_eos", "include_stop_str_in_output",
    "skip_special_tokens", "logprobs", "add_generation_prompt", "return_token_ids",
    "add_special_tokens", "return_tokens_as_token_ids", "include_reasoning", "use_beam_search",
    "length_penalty",
})
"""Fields whose explicit null means their default (``_or_null`` says so in the schema)."""
BEAM_SEARCH_FIELDS = frozenset({
    "model", "prompt", "messages", "n", "max_tokens", "max_completion_tokens", "ignore_eos",
    "use_beam_search", "length_penalty", "temperature", "stream", "stream_options", "user",
    "timeout", "priority", "cache_salt", "echo", "request_id", "add_special_tokens",
    "return_token_ids", "add_generation_prompt", "continue_final_message",
    "chat_template_kwargs", "chat_template", "documents", "include_reasoning",
})
"""The fields a beam search applies; any other set to a value but its default is a 400."""


def _or_null(schema: dict[str, Any]) -> None:
    """``json_schema_extra`` of a ``NULL_MEANS_DEFAULT`` field: its schema also allows null.
    The field itself is typed without None: a null never reaches it (``_null_means_default``
    drops it before validation, so the default applies)."""
    kept: dict[str, Any] = {k: schema.pop(k) for k in ("default", "description", "title")
                            if k in schema}
    inner = dict(schema)
    schema.clear()
    schema.update(kept)
    schema["anyOf"] = [inner, {"type": "null"}]

TokenId = Annotated[int, Field(ge=0, description=TOKEN_ID_DESCRIPTION), Strict()]
"""Strict: ``true`` is not the token id 1, nor ``"5"`` the id 5. The served schema adds the
model's largest id as ``maximum`` (``openapi_schema.py``)."""
StopField = Annotated[
    str | list[str] | None,
    Field(
        description=f"Up to {MAX_STOP} strings; generation stops before (or, with "
        "include_stop_str_in_output, after) the first one produced."
    ),
]


class StreamOptions(RequestBody):
    include_usage: bool = False
    """Send a last chunk with ``usage`` and no choices before ``data: [DONE]``."""
    continuous_usage_stats: bool = False
    """vLLM's: every chunk also carries the ``usage`` so far (needs ``include_usage``)."""


class SamplingFields(StructuredOutputFields):
    """Fields shared by completions and chat completions.

    An explicit ``null`` means the field's default, as in OpenAI's API (``n: null`` is
    ``n: 1``), for the fields in ``NULL_MEANS_DEFAULT`` (``max_tokens: null`` keeps its own
    meaning: up to the context length).
    """

    # Python's JSON parser accepts NaN and Infinity: refuse them in every float field.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = Field(None, description="Served model name; defaults to the only model.")
    n: int = Field(1, ge=1, le=MAX_N, json_schema_extra=_or_null)
    temperature: float | None = Field(
        None, ge=0.0, le=MAX_TEMPERATURE, description="Default 1.0; 0 is greedy."
    )
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, description="Token id (as a string) -> bias added to its logit."
    )
    stop: StopField = None
    stream: bool = Field(False, json_schema_extra=_or_null)
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras.
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: off.")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    min_tokens: int = Field(0, ge=0, json_schema_extra=_or_null)
    ignore_eos: bool = Field(False, json_schema_extra=_or_null)
    include_stop_str_in_output: bool = Field(False, json_schema_extra=_or_null)
    skip_special_tokens: bool = Field(True, json_schema_extra=_or_null)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP)
    allowed_token_ids: list[TokenId] | None = Field(
        None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS,
        description="Sample only among these token ids (every other logit is -inf).")
    bad_words: list[str] | None = Field(
        None, max_length=MAX_BAD_WORDS,
        description="Words never generated: a word's last token is blocked whenever the "
        "output ends with its other tokens (each word as it is and after a space).")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="Keep only the prompt's last k tokens (-1: max_model_len).")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS,
        description="The log-probability of every prompt token and the most likely tokens at "
        "its position: in each choice (completions) or in the response (chat); not with stream.")
    return_token_ids: bool = Field(
        False, description="Add the prompt's token ids (prompt_token_ids) and each choice's "
        "(token_ids); a stream sends the prompt's in its first chunk, each chunk's new ids.",
        json_schema_extra=_or_null)
    return_tokens_as_token_ids: bool = Field(
        False, description='Name the tokens of logprobs "token_id:N" instead of their text.',
        json_schema_extra=_or_null)
    cache_salt: str | None = Field(
        None, min_length=1, description="Prefix-cache hits only between requests with the same "
        "salt (tenants that must not probe each other's prompts through timing).")
    request_id: str | None = Field(
        None, min_length=1, max_length=MAX_REQUEST_ID_CHARS,
        description="The response's id after its prefix (cmpl-, chatcmpl-); an X-Request-Id "
        "header wins over it. Default: a random id.")
    use_beam_search: bool = Field(
        False, description="Beam search: the n most likely completions (n beams, at most "
        f"{MAX_BEAM_WIDTH}), best first; other sampling fields do not apply (400).",
        json_schema_extra=_or_null)
    length_penalty: float = Field(
        1.0, description="Beam search: a beam's score is its log-probability over its "
        "length to this power.", json_schema_extra=_or_null)
    # pagedserve's extra.
    timeout: float | None = Field(
        None,
        gt=0.0,
        description="Seconds from arrival (queueing included) after which the request is "
        "aborted: 408 with code request_timeout, or that error as the last event of a stream.",
    )
    priority: int = Field(
        0,
        description="Lower is scheduled first (vLLM's convention); needs the server's "
        "--policy priority, refused otherwise.",
    )

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if not (v is None and k in NULL_MEANS_DEFAULT)}

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not key.lstrip("-").isdigit() or int(key) < 0:
                raise ValueError(f"keys must be token ids, got {key!r}")
        return bias

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries the usage so far."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats

    def _check_stream_fields(self) -> None:
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not available with stream")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats and (
            not self.stream_options.include_usage
        ):
            raise ValueError("stream_options.continuous_usage_stats: needs include_usage")

    def _beam_search_params(self, max_tokens: int | None) -> BeamSearchParams:
        """``use_beam_search``: the beams' parameters; a field the search would not apply,
        set to anything but its default, is refused by name."""
        fields = type(self).model_fields
        for name in sorted(self.model_fields_set - BEAM_SEARCH_FIELDS):
            if getattr(self, name) != fields[name].default:
                raise ValueError(f"{name}: does not apply to beam search (use_beam_search)")
        if self.n > MAX_BEAM_WIDTH:
            raise ValueError(f"n: beam search takes at most {MAX_BEAM_WIDTH} beams, got {self.n}")
        if self.temperature:
            raise ValueError("temperature: beam search ranks beams by the model's "
                             "log-probabilities; leave it out or send 0")
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens,
                                ignore_eos=self.ignore_eos, length_penalty=self.length_penalty)

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
        defaults: Mapping[str, Any],
    ) -> SamplingParams:
        """``defaults``: the model's generation_config values (``default_sampling_values``)
        for the fields the request leaves unset; then the engine's own defaults."""

        self._check_stream_fields()
        if self.length_penalty != 1.0:
            raise ValueError("length_penalty: applies to beam search only (use_beam_search)")

        def given(name: str, engine_default: Any) -> Any:
            value = getattr(self, name)
            return defaults.get(name, engine_default) if value is None else value

        return SamplingParams(
            n=self.n,
            temperature=given("temperature", 1.0),
            top_p=given("top_p", 1.0),
            top_k=given("top_k", 0),
            min_p=given("min_p", 0.0),
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=given("repetition_penalty", 1.0),
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=self.structured_outputs_params(),
        )


Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
PromptField = Text | Annotated[list[Text], Field(min_length=1)] | TokenIds | Annotated[
    list[TokenIds], Field(min_length=1)
]


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: PromptField = Field(
        ..., description="A string, a list of strings, token ids, or a list of token-id lists."
    )
    max_tokens: int | None = Field(
        16, ge=0, description="null: up to the context length; 0 (with echo): the prompt only.")
    echo: bool = Field(False, description="Return the prompt in front of the completion.",
                       json_schema_extra=_or_null)
    add_special_tokens: bool = Field(
        True, description="Add the tokenizer's special tokens (BOS) to a text prompt.",
        json_schema_extra=_or_null)
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Top log-probabilities per token (legacy format)."
    )

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt_text(cls, prompt: object) -> object:
        """Before the type check, which would call a lone surrogate "not a valid string"."""
        for text in [prompt] if isinstance(prompt, str) else prompt if isinstance(
            prompt, list
        ) else []:
            if isinstance(text, str):
                check_unicode("prompt", text)
        return prompt

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: PromptField) -> PromptField:
        if isinstance(prompt, str):
            prompt_list: list = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt_list = [prompt]
        else:
            prompt_list = list(prompt)
        if not prompt_list or any(len(p) == 0 for p in prompt_list):
            raise ValueError("prompt must not be empty")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: one entry per prompt (a string or token ids)."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [list(self.prompt)]
        return list(self.prompt)

    def to_sampling_params(
        self, defaults: Mapping[str, Any] | None = None
    ) -> SamplingParams | BeamSearchParams:
        """``defaults``: the model's default sampling values, for the fields left unset."""
        defaults = defaults or {}
        # echo with logprobs also reports the prompt tokens' logprobs, as the legacy API does.
        echo_logprobs = self.logprobs if self.echo else None
        prompt_logprobs = max((k for k in (echo_logprobs, self.prompt_logprobs) if k is not None),
                              default=None)
        max_tokens = self.max_tokens
        if "max_tokens" not in self.model_fields_set:
            max_tokens = defaults.get("max_tokens", max_tokens)
        if max_tokens == 0:
            if not self.echo:
                raise ValueError("max_tokens: 0 needs echo (the response is the prompt alone)")
            if self.use_beam_search:
                raise ValueError("max_tokens: beam search needs at least 1")
            max_tokens = 1  # the engine computes one token, which the response leaves out
        if self.use_beam_search:
            return self._beam_search_params(max_tokens)
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs, defaults)

    @property
    def echo_only(self) -> bool:
        """``max_tokens: 0`` with echo: each choice is the prompt, without a completion."""
        return self.echo and self.max_tokens == 0


class TextPart(RequestBody):
    type: Literal["text"]
    text: str


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(
        None, description="An assistant turn's calls (their arguments reach the chat template "
        "as objects).")
    tool_call_id: str | None = Field(None, description="A tool turn: the call it answers.")

    @model_validator(mode="after")
    def _check_tool_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise PydanticCustomError("tool_calls_role", "only an assistant message has tool_calls")
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise PydanticCustomError("tool_call_id_role",
                                      "a tool message has a tool_call_id, and only it")
        return self

    def chat_dict(self) -> dict[str, Any]:
        """The message as the chat template reads it (``name`` kept for templates that show
        it, as vLLM does)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls is not None:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(ToolFields, SamplingFields):
    """``POST /v1/chat/completions``."""

    model_config = ConfigDict(  # merged with SamplingFields'
        json_schema_extra={"dependentRequired": {"top_logprobs": ["logprobs"]}}
    )

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(
        None, ge=1, description="Deprecated alias of max_completion_tokens."
    )
    max_completion_tokens: int | None = Field(
        None, ge=1, description="null: up to the context length."
    )
    logprobs: bool = Field(False, json_schema_extra=_or_null)
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS,
        description="Most likely tokens per position; needs logprobs: true (400 otherwise).",
    )
    echo: bool = Field(
        False,
        description="Prepend the last message's content when it is the "
        "assistant's (vLLM's chat echo).",
        json_schema_extra=_or_null,
    )
    add_generation_prompt: bool = Field(True, json_schema_extra=_or_null)
    continue_final_message: bool = Field(
        False, description="Continue the last (assistant) message instead of starting a new "
        "turn; the generation prompt is then not added.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra chat template variables (Qwen3's enable_thinking).")
    chat_template: str | None = Field(
        None, min_length=1, max_length=MAX_CHAT_TEMPLATE_CHARS,
        description="Jinja text rendering this request's messages instead of the model's "
        "template; needs the server's --trust-request-chat-template.")
    documents: list[dict[str, str]] | None = Field(
        None, max_length=MAX_DOCUMENTS, description="Retrieved texts ({title, text}) for chat "
        "templates that render documents (RAG); others ignore them.")
    include_reasoning: bool = Field(
        True, description="false: leave the --reasoning-parser's reasoning_content out.",
        json_schema_extra=_or_null)

    def chat_dicts(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them."""
        return [m.chat_dict() for m in self.messages]

    def chat_options(self) -> ChatRenderOptions:
        """add_generation_prompt left unset follows continue_final_message."""
        given = "add_generation_prompt" in self.model_fields_set
        return ChatRenderOptions.of(self.add_generation_prompt if given else None,
                                    self.continue_final_message, self.chat_template_kwargs,
                                    self.template_tools(), self.chat_template, self.documents)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """``tool_choice``'s constraint, or the one the request's structured-output fields
        set; not both."""
        tool_constraint = self.tool_constraint()
        given = super().structured_outputs_params()
        if tool_constraint is not None and given is not None:
            raise ValueError("tool_choice: 'required' or a named function constrains the "
                             "output already; it cannot be combined with response_format, "
                             "structured_outputs or guided_*")
        return tool_constraint or given

    def to_sampling_params(
        self, defaults: Mapping[str, Any] | None = None
    ) -> SamplingParams | BeamSearchParams:
        """``defaults``: the model's default sampling values, for the fields left unset."""
        defaults = defaults or {}
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        if max_tokens is None:
            max_tokens = defaults.get("max_tokens")
        if self.use_beam_search:
            return self._beam_search_params(max_tokens)
        params = self._sampling_params(max_tokens, logprobs, self.prompt_logprobs, defaults)
        if self.effective_tool_choice == "auto" and (
            "skip_special_tokens" not in self.model_fields_set
        ):
            params.skip_special_tokens = False  # some models' tool-call markup is one
        return params


class TokenizeRequest(RequestBody):
    """``POST /tokenize``: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    # As chat completions render messages (vLLM's TokenizeChatRequest).
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = Field(None, min_length=1, max_length=MAX_CHAT_TEMPLATE_CHARS)
    tools: list[ChatTool] | None = Field(None, max_length=128)
    documents: list[dict[str, str]] | None = Field(None, max_length=MAX_DOCUMENTS)

    def chat_options(self) -> ChatRenderOptions:
        """The rendering of ``messages``, as a chat request with these fields renders it."""
        given = "add_generation_prompt" in self.model_fields_set
        tools = [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None
        return ChatRenderOptions.of(self.add_generation_prompt if given else None,
                                    self.continue_final_message, self.chat_template_kwargs,
                                    tools, self.chat_template, self.documents)


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]
