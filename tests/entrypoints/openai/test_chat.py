"""``/v1/chat/completions`` through the official ``openai`` client against a real server."""

from __future__ import annotations

import httpx
import openai

from tests.entrypoints.openai.server_utils import API_KEY, ServerProcess

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello there"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "What is the capital of France?"},
]
NO_EOS = {"ignore_eos": True}


def _chat(client: openai.OpenAI, model: str, **kwargs):
    kwargs.setdefault("max_completion_tokens", 8)
    return client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0.0, extra_body=NO_EOS, **kwargs
    )


def test_chat_uses_the_template_and_counts_usage(
    client: openai.OpenAI, server: ServerProcess, model_name: str
) -> None:
    response = _chat(client, model_name)
    assert response.object == "chat.completion"
    message = response.choices[0].message
    assert message.role == "assistant" and response.choices[0].finish_reason == "length"
    # The same prompt, rendered by /tokenize and sent as token ids, gives the same text.
    r = httpx.post(
        f"{server.url}/tokenize",
        json={"messages": MESSAGES},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    ids = r.json()["tokens"]
    assert r.json()["count"] == len(ids) == response.usage.prompt_tokens
    completion = client.completions.create(
        model=model_name, prompt=ids, max_tokens=8, temperature=0.0, extra_body=NO_EOS
    )
    assert message.content == completion.choices[0].text
    assert response.usage.completion_tokens == 8
    assert response.usage.total_tokens == len(ids) + 8


def test_chat_streaming_matches_non_streaming(client: openai.OpenAI, model_name: str) -> None:
    full = _chat(client, model_name, max_completion_tokens=10)
    roles, content, finish, usage = [], "", None, None
    for chunk in _chat(
        client,
        model_name,
        max_completion_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    ):
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert roles == ["assistant"]
    assert content == full.choices[0].message.content
    assert finish == "length"
    assert usage is not None and usage.model_dump() == full.usage.model_dump()


def test_chat_n2_logprobs(client: openai.OpenAI, model_name: str) -> None:
    response = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        n=2,
        temperature=1.0,
        seed=7,
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        extra_body=NO_EOS,
    )
    assert [c.index for c in response.choices] == [0, 1]
    assert response.usage.completion_tokens == 10
    for choice in response.choices:
        entries = choice.logprobs.content
        assert len(entries) == 5
        for entry in entries:
            assert entry.logprob <= 0.0
            assert entry.bytes == list(entry.token.encode("utf-8"))
            assert len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
            assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-4


def test_chat_streaming_logprobs_and_n(client: openai.OpenAI, model_name: str) -> None:
    counts = {0: 0, 1: 0}
    for chunk in client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        n=2,
        max_tokens=4,
        temperature=0.0,
        stream=True,
        logprobs=True,
        top_logprobs=1,
        extra_body=NO_EOS,
    ):
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                counts[choice.index] += len(choice.logprobs.content)
    assert counts == {0: 4, 1: 4}


def test_chat_echo_prepends_the_assistant_prefix(client: openai.OpenAI, model_name: str) -> None:
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi"}]
    plain = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=3, temperature=0.0, extra_body=NO_EOS
    )
    echoed = client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=3,
        temperature=0.0,
        extra_body={**NO_EOS, "echo": True},
    )
    assert echoed.choices[0].message.content == "Hi" + plain.choices[0].message.content


def test_continue_final_message_and_chat_template_kwargs(
    client: openai.OpenAI, model_name: str
) -> None:
    messages = [{"role": "user", "content": "Hello there"},
                {"role": "assistant", "content": "The capital of France"}]

    def create(**extra):
        return client.chat.completions.create(
            model=model_name, messages=messages, temperature=0.0, max_completion_tokens=4,
            extra_body={**NO_EOS, **extra})

    new_turn = create()
    continued = create(continue_final_message=True)
    assert continued.choices[0].message.content  # the reply continues the prefix
    # No end of the assistant turn and no new generation prompt after the prefix.
    assert continued.usage.prompt_tokens < new_turn.usage.prompt_tokens
    # A variable the template does not read renders the same prompt.
    assert create(chat_template_kwargs={"enable_thinking": False}).usage.prompt_tokens == (
        new_turn.usage.prompt_tokens)
    for bad in ({"continue_final_message": True, "add_generation_prompt": True},
                {"chat_template_kwargs": {"tokenize": True}}):
        try:
            create(**bad)
        except openai.BadRequestError as e:
            assert next(iter(bad)) in str(e)
        else:
            raise AssertionError(f"{bad} was accepted")


TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_a_request_brings_its_own_chat_template(
    client: openai.OpenAI, server: ServerProcess, model_name: str
) -> None:
    """The shared server runs with --trust-request-chat-template: the request's template
    renders its messages (the same tokens as that text sent to completions); a template that
    is not Jinja, or fails to render, is a 400 naming chat_template."""
    response = client.chat.completions.create(
        model=model_name, messages=MESSAGES, temperature=0.0, max_completion_tokens=8,
        extra_body={**NO_EOS, "chat_template": TEMPLATE})
    text = "".join(f"<{m['role']}>{m['content']}\n" for m in MESSAGES) + "<assistant>"
    completion = client.completions.create(
        model=model_name, prompt=text, max_tokens=8, temperature=0.0,
        extra_body={**NO_EOS, "add_special_tokens": False})
    assert response.choices[0].message.content == completion.choices[0].text
    assert response.usage.prompt_tokens == completion.usage.prompt_tokens
    for bad in ("{% for %}", "{{ raise_exception('no') }}"):
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                       headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"messages": MESSAGES, "max_tokens": 1, "chat_template": bad})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "chat_template"


def test_tokenize_renders_messages_as_chat_does(
    client: openai.OpenAI, server: ServerProcess, model_name: str
) -> None:
    """/tokenize takes the chat fields that change the rendering (tools, chat_template,
    chat_template_kwargs, continue_final_message): its count is the chat's prompt_tokens."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    cases = [{"tools": [tool], "tool_choice": "none"}, {"chat_template": TEMPLATE},
             {"continue_final_message": True, "add_generation_prompt": False}]
    messages = [*MESSAGES, {"role": "assistant", "content": "It is"}]
    for fields in cases:
        chat = client.chat.completions.create(model=model_name, messages=messages,
                                              max_completion_tokens=1, extra_body=fields)
        tokenize_fields = {k: v for k, v in fields.items() if k != "tool_choice"}
        r = httpx.post(f"{server.url}/tokenize", timeout=30,
                       headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"messages": messages, **tokenize_fields})
        assert r.status_code == 200, r.text
        assert r.json()["count"] == chat.usage.prompt_tokens, fields


DOCS_TEMPLATE = ("{% for d in documents %}[{{ d['title'] }}] {{ d['text'] }}\n{% endfor %}"
                 + TEMPLATE)


def test_documents_reach_the_template(
    client: openai.OpenAI, server: ServerProcess, model_name: str
) -> None:
    """vLLM's ``documents`` (RAG): given to the template as transformers gives them; the
    prompt is the template's text with them, on chat completions and /tokenize alike."""
    documents = [{"title": "Paris", "text": "The capital of France."}]
    fields = {"chat_template": DOCS_TEMPLATE, "documents": documents}
    chat = client.chat.completions.create(model=model_name, messages=MESSAGES,
                                          max_completion_tokens=1, extra_body=fields)
    text = "[Paris] The capital of France.\n" + "".join(
        f"<{m['role']}>{m['content']}\n" for m in MESSAGES) + "<assistant>"
    completion = client.completions.create(model=model_name, prompt=text, max_tokens=1,
                                           extra_body={"add_special_tokens": False})
    assert chat.usage.prompt_tokens == completion.usage.prompt_tokens
    r = httpx.post(f"{server.url}/tokenize", timeout=30,
                   headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"messages": MESSAGES, **fields})
    assert r.json()["count"] == completion.usage.prompt_tokens
    bad = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                     headers={"Authorization": f"Bearer {API_KEY}"},
                     json={"messages": MESSAGES, "documents": [{"title": 3}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("documents")
