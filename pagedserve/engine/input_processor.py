"""User input -> engine requests: validate sampling parameters, tokenize, apply the chat template.

A prompt is a string, a list of token ids, or a dict like vLLM's ``TokensPrompt`` /
``TextPrompt`` (``{"prompt_token_ids": [...]}`` or ``{"prompt": "..."}``, optionally both, and
optionally a ``cache_salt``).
A request with ``n > 1`` becomes ``n`` child ``Request`` objects (ids ``f"{i}_{parent_id}"``)
that the scheduler runs independently; their identical prompts share KV blocks through the
prefix cache. The output processor folds them back into one ``RequestOutput``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2

from pagedserve.beam_search import BeamSearch, BeamSearchParams, expansion_params
from pagedserve.core.request import Request
from pagedserve.engine.chat_messages import (
    ChatMessages,
    ChatRenderOptions,
    load_chat_template,
    text_messages,
)
from pagedserve.field_types import token_id_list
from pagedserve.lora.request import LoRARequest
from pagedserve.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams

if TYPE_CHECKING:
    from pagedserve.lora.check import LoRAChecker

PromptType = str | list[int] | dict[str, Any]


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
    """The ``n`` children, in completion-index order; ``n == 1``: one request with ``request_id``.
    Empty for a beam search, whose frontend sends each round's expansions itself."""
    arrival_time: float
    beam_search: BeamSearch | None = None
    """Set for a beam search (``BeamSearchParams``); ``sampling_params`` are then those of
    each expansion request."""


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


def _cache_salt(prompt: PromptType) -> str | None:
    """A dict prompt's ``cache_salt`` (vLLM's): its prefix-cache hits come only from prompts
    with the same salt."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and not (isinstance(salt, str) and salt):
        raise ValueError(f"cache_salt: expected a non-empty string, got {salt!r}")
    return salt


def _require_sampling_params(params: object) -> None:
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")


def bad_word_token_ids(tokenizer: Any, word: str) -> list[list[int]]:
    """The token sequences of one bad word, as vLLM's ``update_from_tokenizer`` makes them: the
    word (leading whitespace stripped), then the word after a space, kept only when its first
    token differs and its length does not (a word in the middle of a text, when the tokenizer
    folds the space into the word's first token)."""
    word = word.lstrip()
    plain = list(tokenizer.encode(word, add_special_tokens=False))
    spaced = list(tokenizer.encode(" " + word, add_special_tokens=False))
    if not plain:
        raise ValueError(f"bad_words: {word!r} has no tokens")
    if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
        return [plain, spaced]
    return [plain]


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
        lora: LoRAChecker | None = None,
    ) -> None:
        """``lora``: checks requests' adapters; None where the engine serves none."""
        self.tokenizer = tokenizer
        self.lora = lora
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
        lora: LoRAChecker | None = None,
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
                   parse_special_tokens_in_content, template, lora)

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
        messages = text_messages(messages)
        tokenizer = self._require_tokenizer("messages")
        if options.chat_template is None and self.chat_template is None and getattr(
            tokenizer, "chat_template", None
        ) is None:
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

    def _apply_template(self, messages: ChatMessages, options: ChatRenderOptions) -> str:
        """The rendered conversation; a template that refuses it (Llama 2's and Mistral's
        refuse a system turn or roles that do not alternate) gives a ValueError with its
        message. ``continue_final_message`` cuts the text after the last message's content,
        as transformers does; a template that alters that content cannot be continued."""
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                chat_template=options.chat_template or self.chat_template,
                tokenize=False,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message,
                tools=options.tools,
                documents=options.documents,
                **options.chat_template_kwargs,
            )
        except jinja2.TemplateError as e:
            if options.chat_template is not None:
                raise ValueError(f"chat_template: rendering the messages failed: {e}") from None
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
        """Validate ``params`` against the model; return a copy with ``max_tokens`` filled,
        the model's extra EOS ids in ``stop_token_ids`` and the token sequences of
        ``bad_words`` in ``bad_words_token_ids`` (the caller's object is not changed)."""
        _require_sampling_params(params)
        self._check_token_ids("stop_token_ids", params.stop_token_ids)
        self._check_token_ids("logit_bias", list(params.logit_bias or {}))
        self._check_token_ids("allowed_token_ids", params.allowed_token_ids or [])
        for ids in params.bad_words_token_ids or ():
            self._check_token_ids("bad_words_token_ids", ids)
        if params.stop and not params.detokenize:
            raise ValueError("stop: stop strings need detokenize=True")
        if params.stop:
            self._require_tokenizer("stop")
        resolved = params.clone()
        resolved.max_tokens = self._resolve_max_tokens(params, num_prompt_tokens)
        if params.bad_words:
            resolved.bad_words_token_ids = self._bad_words_token_ids(params)
        if not params.ignore_eos:
            extra = [t for t in self.extra_eos_token_ids if t not in resolved.stop_token_ids]
            resolved.stop_token_ids = resolved.stop_token_ids + extra
        return resolved

    def _bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        """``bad_words_token_ids`` with every word's sequences added (no duplicates)."""
        if self.tokenizer is None:
            raise ValueError("bad_words: needs a tokenizer, and the engine runs without one "
                             "(give bad_words_token_ids instead)")
        sequences = [list(ids) for ids in params.bad_words_token_ids or ()]
        for word in params.bad_words or ():
            self.check_text("bad_words", word)
            for ids in bad_word_token_ids(self.tokenizer, word):
                if len(ids) > MAX_BAD_WORD_TOKENS:
                    raise ValueError(f"bad_words: {word!r} is {len(ids)} tokens, more than "
                                     f"{MAX_BAD_WORD_TOKENS}")
                self._check_token_ids("bad_words", ids)
                if ids not in sequences:
                    sequences.append(ids)
        return sequences

    # -- requests ------------------------------------------------------------------------------

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """Validate and tokenize one request and fan it out into its ``n`` children.

        Raises ``ValueError`` naming the field (prompt, max_tokens, stop_token_ids, ...).
        """
        self._check_lora(lora_request)
        if isinstance(params, BeamSearchParams):
            return self._process_beam_search(request_id, prompt, params, arrival_time, priority,
                                             lora_request)
        _require_sampling_params(params)
        text, prompt_token_ids = self._truncate(params, *self.tokenize(prompt))
        cache_salt = _cache_salt(prompt)
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
                cache_salt=cache_salt,
                lora_request=lora_request,
            )
            for i in range(resolved.n)
        ]
        return ProcessedRequest(
            request_id, text, prompt_token_ids, resolved, requests, arrival_time
        )

    def _check_lora(self, lora_request: LoRARequest | None) -> None:
        if lora_request is None:
            return
        if self.lora is None:
            raise ValueError("lora_request: this engine serves no LoRA adapters (start it "
                             "with enable_lora=True; --enable-lora on the command line)")
        self.lora.check(lora_request)

    def _process_beam_search(
        self, request_id: str, prompt: PromptType, params: BeamSearchParams,
        arrival_time: float | None, priority: int, lora_request: LoRARequest | None,
    ) -> ProcessedRequest:
        """Validated as a request for ``params.max_tokens`` tokens is; its EOS ids are those
        that request would stop on."""
        probe = self.process_inputs(
            request_id, prompt,
            SamplingParams(max_tokens=params.max_tokens, ignore_eos=params.ignore_eos),
            arrival_time, priority, lora_request,
        )
        resolved = probe.sampling_params
        assert resolved.max_tokens is not None  # resolve_params fills it
        eos_ids = set() if params.ignore_eos else {self.eos_token_id, *resolved.stop_token_ids}
        search = BeamSearch(
            probe.prompt_token_ids, params, resolved.max_tokens,
            frozenset(t for t in eos_ids if t is not None), priority,
            probe.requests[0].cache_salt, lora_request,
        )
        return dataclasses.replace(probe, sampling_params=expansion_params(params), requests=[],
                                   beam_search=search)

    def _truncate(
        self, params: SamplingParams, text: str | None, token_ids: list[int]
    ) -> tuple[str | None, list[int]]:
        """``truncate_prompt_tokens``: the prompt's last k tokens (vLLM's left truncation); the
        text is then the kept tokens' (None without a tokenizer)."""
        keep = params.truncate_prompt_tokens
        if keep == -1:
            keep = self.max_model_len
        if keep is None or len(token_ids) <= keep:
            return text, token_ids
        kept = token_ids[-keep:]
        return (None if self.tokenizer is None else self.tokenizer.decode(kept)), kept

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
