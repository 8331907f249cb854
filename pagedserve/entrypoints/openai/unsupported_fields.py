"""Request fields of OpenAI's API and of vLLM's extras that this server does not implement.

Every request body forbids unknown fields (as OpenAI's API does): a field the server would
otherwise drop is a 400. The fields named here get "X is not supported" (and why, where a
reason helps), any other unknown field gets "X: unknown field". docs/serving.md lists them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

_FUNCTIONS = "deprecated by OpenAI: use tools and tool_choice"
_BEAM = "use_beam_search with n gives the n most likely completions"
_CHAT_ONLY = "a chat completions field"
_MULTIMODAL = "the models served are text-only"

UNSUPPORTED_FIELDS: dict[str, str] = {
    # OpenAI chat completions.
    "tools": _CHAT_ONLY,  # implemented on chat completions, as the next four
    "tool_choice": _CHAT_ONLY,
    "parallel_tool_calls": _CHAT_ONLY,
    "tool_calls": _CHAT_ONLY,
    "tool_call_id": _CHAT_ONLY,
    "functions": _FUNCTIONS,
    "function_call": _FUNCTIONS,
    "audio": _MULTIMODAL,
    "modalities": _MULTIMODAL,
    "prediction": "predicted outputs are not implemented",
    "service_tier": "",
    "store": "",
    "metadata": "",
    "reasoning_effort": "",
    "verbosity": "",
    "web_search_options": "",
    "prompt_cache_key": "prefix caching is automatic",
    "safety_identifier": "",
    "refusal": "",
    "moderation": "",
    "prompt_cache_options": "prefix caching is automatic",
    "prompt_cache_retention": "prefix caching is automatic",
    "include_obfuscation": "",
    # OpenAI responses.
    "previous_response_id": "responses are not stored",
    "conversation": "responses are not stored",
    "background": "",
    "include": "",
    "reasoning": "reasoning is the --reasoning-parser's",
    "max_tool_calls": "",
    "truncation": "",
    "top_logprobs": "",
    # OpenAI (legacy) completions.
    "best_of": _BEAM,
    "suffix": "",
    # vLLM's extras.
    "early_stopping": "a beam search runs until no beam is live or max_tokens",
    "spaces_between_special_tokens": "",
    "add_special_tokens": "a completions field; a chat template writes its own special tokens",
    "continue_final_message": _CHAT_ONLY,  # implemented on chat completions
    "chat_template": _CHAT_ONLY,  # implemented on chat completions
    "chat_template_kwargs": _CHAT_ONLY,  # implemented on chat completions
    "documents": _CHAT_ONLY,  # implemented on chat completions
    "mm_processor_kwargs": _MULTIMODAL,
    "media_io_kwargs": _MULTIMODAL,
    "prompt_embeds": "",
    "guided_decoding_backend": "the backend is xgrammar",
    "guided_whitespace_pattern": "",
    "structural_tag": "use response_format {type: structural_tag} or "
                      "structured_outputs.structural_tag",
    "logits_processors": "",
    "kv_transfer_params": "",
    "vllm_xargs": "",
    "continuous_usage_stats": "",
}
"""Field name -> why it is refused ("" when the name says enough)."""


def unsupported_message(param: str, name: str) -> tuple[str, str]:
    """The 400's message and error code (OpenAI's) for the field ``name`` the body does not
    declare (at ``param``, its path)."""
    if name not in UNSUPPORTED_FIELDS:
        return f"{param}: unknown field", "unknown_parameter"
    reason = UNSUPPORTED_FIELDS[name]
    return f"{param} is not supported" + (f" ({reason})" if reason else ""), "unsupported_parameter"


class RequestBody(BaseModel):
    """Base of every request body and of the objects inside one: unknown fields are refused
    (``additionalProperties: false`` in ``/openapi.json``)."""

    model_config = ConfigDict(extra="forbid")
