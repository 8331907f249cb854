"""Every error class answers with its status and OpenAI's error shape, and the server keeps
serving; the open routes (health, metrics, version) and the tokenizer routes."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.entrypoints.openai.server_utils import API_KEY, MAX_MODEL_LEN, ServerProcess

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _post(
    server: ServerProcess, path: str, body: object, headers: dict | None = None
) -> httpx.Response:
    headers = AUTH if headers is None else headers
    if isinstance(body, (bytes, str)):
        return httpx.post(
            f"{server.url}{path}",
            content=body,
            timeout=60,
            headers={**headers, "Content-Type": "application/json"},
        )
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


BAD_COMPLETIONS = [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 100_000}, "n"),
    ({"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"prompt": "hi", "stop": ["x"] * 1000}, "stop"),
    ({"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS, ids=[p for _, p in BAD_COMPLETIONS])
def test_bad_completion_fields_are_400_naming_the_field(
    server: ServerProcess, model_name: str, body: dict, param: str
) -> None:
    err = _error(_post(server, "/v1/completions", {"model": model_name, **body}), 400)
    assert err["param"] == param and param in err["message"]
    assert err["type"] == "invalid_request_error"


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "url": "x"}]}]},
        "messages[0].content",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHATS, ids=[p for _, p in BAD_CHATS])
def test_bad_chat_fields_are_400(
    server: ServerProcess, model_name: str, body: dict, param: str
) -> None:
    err = _error(_post(server, "/v1/chat/completions", {"model": model_name, **body}), 400)
    assert err["param"] == param


def test_malformed_json_and_context_overflow(server: ServerProcess, model_name: str) -> None:
    err = _error(_post(server, "/v1/completions", b'{"prompt": "hi", '), 400)
    assert err["code"] == "invalid_json"
    _error(_post(server, "/v1/completions", b'{"prompt": "\xff\xfe"}'), 400)  # not UTF-8
    _error(_post(server, "/v1/completions", b'["prompt"]'), 400)  # not an object
    _error(_post(server, "/v1/completions", b""), 400)
    err = _error(
        _post(
            server,
            "/v1/completions",
            {"model": model_name, "prompt": "hi", "max_tokens": MAX_MODEL_LEN},
        ),
        400,
    )
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    err = _error(
        _post(
            server, "/v1/completions", {"model": model_name, "prompt": [5] * (MAX_MODEL_LEN + 10)}
        ),
        400,
    )
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    err = _error(
        _post(
            server,
            "/v1/chat/completions",
            {
                "model": model_name,
                "max_completion_tokens": MAX_MODEL_LEN,
                "messages": [{"role": "user", "content": "hi"}],
            },
        ),
        400,
    )
    assert err["code"] == "context_length_exceeded"


def test_auth_unknown_model_and_unknown_route(server: ServerProcess, model_name: str) -> None:
    body = {"model": model_name, "prompt": "hi", "max_tokens": 2}
    err = _error(_post(server, "/v1/completions", body, headers={}), 401)
    assert err["code"] == "invalid_api_key" and err["type"] == "authentication_error"
    _error(_post(server, "/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
    _error(httpx.get(f"{server.url}/v1/models", timeout=10), 401)
    _error(_post(server, "/tokenize", {"prompt": "hi"}, headers={}), 401)
    err = _error(_post(server, "/v1/completions", {**body, "model": "gpt-9"}), 404)
    assert err["param"] == "model" and err["code"] == "model_not_found"
    _error(
        _post(
            server,
            "/v1/chat/completions",
            {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]},
        ),
        404,
    )
    _error(httpx.get(f"{server.url}/v1/nothing-here", headers=AUTH, timeout=10), 404)
    # Open routes need no key.
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/version", timeout=10).json()["version"]
    assert "pagedserve:num_requests_running" in httpx.get(f"{server.url}/metrics", timeout=10).text


def test_openai_client_raises_typed_errors_and_server_keeps_serving(
    client: openai.OpenAI, server: ServerProcess, model_name: str
) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_name, prompt="hi", temperature=-2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    bad_key = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    response = client.completions.create(
        model=model_name, prompt="hi", max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert response.usage.completion_tokens == 2


def test_models_tokenize_detokenize(
    client: openai.OpenAI, server: ServerProcess, model_name: str
) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [model_name]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    r = _post(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    body = r.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 0
    assert body["max_model_len"] == MAX_MODEL_LEN
    r = _post(server, "/detokenize", {"tokens": body["tokens"]})
    assert r.json() == {"prompt": "Hello world"}
    err = _error(_post(server, "/detokenize", {"tokens": [10**9]}), 400)
    assert err["param"] == "tokens"
    _error(
        _post(server, "/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}),
        400,
    )


def test_openapi_schema_states_what_is_accepted(server: ServerProcess) -> None:
    schema = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/metrics",
        "/version",
    ):
        assert path in schema["paths"], path
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert schema["components"]["schemas"]["CompletionRequest"]["required"] == ["prompt"]
    assert props["temperature"]["anyOf"][0]["minimum"] == 0.0
    top_p = props["top_p"]["anyOf"][0]
    assert top_p["exclusiveMinimum"] == 0.0 and top_p["maximum"] == 1.0
    n = props["n"]["anyOf"][0]  # or null: the default
    assert n["minimum"] == 1 and n["maximum"] == 128
    for extra in (
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "echo",
        "logprobs",
        "seed",
    ):
        assert extra in props, extra
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["properties"]["messages"]["minItems"] == 1
    # The API key is documented where it is required, and only there.
    assert "security" in schema["paths"]["/v1/completions"]["post"]
    assert "security" not in schema["paths"]["/health"]["get"]


def test_a_value_error_outside_the_input_checks_is_a_500_not_a_400() -> None:
    """Only input checks (inside ``engine_errors``) are the client's fault; a ValueError from
    anywhere else is a bug of the server and must not read as a bad field."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from pagedserve.entrypoints.openai.errors import install_error_handlers
    from pagedserve.entrypoints.openai.serving_common import engine_errors

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/input")
    def _input() -> None:
        with engine_errors():
            raise ValueError("top_p must be in (0, 1], got 2")

    @app.get("/bug")
    def _bug() -> None:
        list(zip([1, 2], [1], strict=True))

    client = TestClient(app, raise_server_exceptions=False)
    assert _error(client.get("/input"), 400)["param"] == "top_p"
    bug = _error(client.get("/bug"), 500)
    assert bug["code"] == "internal_error" and bug["param"] is None
