"""Tiny random checkpoints whose chat templates take tools, in the styles of three model
families (their markup, their tool-call and tool-result turns, calls' arguments as objects):
Llama 3.1 (JSON calls), Qwen2.5 / Hermes (``<tool_call>`` tags) and Mistral
(``[TOOL_CALLS]``, 9-character call ids)."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerFast

from tests.engine.tiny_models import make_model, make_tokenizer
from tests.entrypoints.openai.server_utils import MAX_MODEL_LEN

LLAMA31 = """{{- bos_token }}
{%- if messages[0].role == 'system' %}{%- set system_message = messages[0].content | trim %}\
{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}
{{- system_message + '<|eot_id|>' }}
{%- if tools is not none %}
{%- set first_user_message = messages[0].content | trim %}{%- set messages = messages[1:] %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
{{- 'Given the following functions, please respond with a JSON for a function call with its \
proper arguments that best answers the given prompt.\\n\\n' }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name \
and its value}. Do not use variables.\\n\\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}
{{- first_user_message + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim \
+ '<|eot_id|>' }}
{%- elif 'tool_calls' in message %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{{- '{"name": "' + tool_call.name + '", "parameters": ' + tool_call.arguments | tojson + '}' }}
{{- '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\
{%- endif %}"""

HERMES = """{%- if tools %}{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}\
{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, \
"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or \
(message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\\n' + message.content }}\
{%- endif %}
{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}\
{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}\
{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}\
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

MISTRAL = """{%- if messages[0].role == 'system' %}{%- set system_message = messages[0].content %}\
{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}
{%- set user_messages = loop_messages | selectattr('role', 'equalto', 'user') | list %}
{{- bos_token }}
{%- for message in loop_messages %}
{%- if message.role == 'user' %}
{%- if tools is not none and message == user_messages[-1] %}{{- '[AVAILABLE_TOOLS] [' }}
{%- for tool in tools %}{{- tool | tojson }}{%- if not loop.last %}{{- ', ' }}{%- endif %}\
{%- endfor %}{{- '][/AVAILABLE_TOOLS]' }}{%- endif %}
{%- if loop.last and system_message is defined %}\
{{- '[INST] ' + system_message + '\\n\\n' + message.content + '[/INST]' }}
{%- else %}{{- '[INST] ' + message.content + '[/INST]' }}{%- endif %}
{%- elif message.tool_calls is defined and message.tool_calls is not none %}
{{- '[TOOL_CALLS] [' }}
{%- for tool_call in message.tool_calls %}{%- set out = tool_call.function | tojson %}\
{{- out[:-1] }}
{%- if tool_call.id is not defined or tool_call.id | length != 9 %}\
{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}
{{- ', "id": "' + tool_call.id + '"}' }}
{%- if not loop.last %}{{- ', ' }}{%- else %}{{- ']' + eos_token }}{%- endif %}
{%- endfor %}
{%- elif message.role == 'assistant' %}{{- ' ' + message.content | trim + eos_token }}
{%- elif message.role == 'tool' %}
{%- if message.tool_call_id is not defined or message.tool_call_id | length != 9 %}\
{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}
{{- '[TOOL_RESULTS] {"content": ' + message.content | string + ', "call_id": "' \
+ message.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- else %}{{- raise_exception('Only user, assistant and tool roles are supported, with an \
optional first system message!') }}
{%- endif %}
{%- endfor %}"""

STYLES = {
    "llama3_json": (LLAMA31, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                              "<|python_tag|>"]),
    "hermes": (HERMES, ["<tool_call>", "</tool_call>", "<think>", "</think>"]),
    "mistral": (MISTRAL, ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                          "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]),
}
"""Tool-call parser name -> (chat template, its markup as added tokens)."""


def tool_tokenizer(style: str) -> PreTrainedTokenizerFast:
    """The tiny tokenizer with ``style``'s markup as added tokens and its chat template."""
    template, markup = STYLES[style]
    tokenizer = make_tokenizer()
    tokenizer.add_tokens(markup)
    tokenizer.chat_template = template
    return tokenizer


def save_tool_checkpoint(style: str, folder: Path) -> Path:
    """A tiny random Llama whose tokenizer is ``tool_tokenizer(style)``, with a context of
    ``MAX_MODEL_LEN`` tokens (tool definitions make long prompts)."""
    tokenizer = tool_tokenizer(style)
    model = make_model("llama", len(tokenizer), tokenizer.eos_token_id)
    model.config.max_position_embeddings = MAX_MODEL_LEN
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
