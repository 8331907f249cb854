"""Bad input: each answered with its 4xx in OpenAI's error shape, while greedy streams run
alongside and every one of them still gets its exact text; nothing stays in the engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator

import httpx

from tests.engine.tiny_models import VOCAB_SIZE
from tests.entrypoints.openai.server_utils import ServerProcess
from tests.reliability.reliability_utils import (
    completion_body,
    greedy_alone,
    stream_sse,
    wait_idle,
)
from tests.reliability.server_configs import MAIN_MAX_MODEL_LEN

STREAM_PROMPT = "The quick brown fox"
STREAM_TOKENS = 40
TEN_MB = 10 * 1000 * 1000
HI = [{"role": "user", "content": "hi"}]


def _completion(**fields: object) -> dict:
    return {"prompt": "hi", "max_tokens": 2, **fields}


def _chat(**fields: object) -> dict:
    return {"messages": HI, "max_tokens": 2, **fields}


BadCase = tuple[str, str, object, int, str | None]
"""(name, path, body (dict: JSON; bytes: sent as is), status, param the error names)."""

C, CH = "/v1/completions", "/v1/chat/completions"
BAD_INPUTS: list[BadCase] = [
    ("malformed JSON", C, b'{"prompt": "hi", ', 400, None),
    ("invalid UTF-8", C, b'{"prompt": "\xff\xfe\xfa"}', 400, None),
    ("not an object", C, b'["prompt"]', 400, None),
    ("empty body", C, b"", 400, None),
    ("NaN temperature", C, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("deeply nested JSON", C, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    ("prompt of wrong type", C, {"prompt": 5}, 400, "prompt"),
    ("max_tokens of wrong type", C, _completion(max_tokens="ten"), 400, "max_tokens"),
    ("stream of wrong type", C, _completion(stream=[1]), 400, "stream"),
    ("messages of wrong type", CH, {"messages": "hi"}, 400, "messages"),
    ("missing prompt", C, {"max_tokens": 2}, 400, "prompt"),
    ("missing messages", CH, {"max_tokens": 2}, 400, "messages"),
    ("message without role", CH, {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ("negative max_tokens", C, _completion(max_tokens=-1), 400, "max_tokens"),
    ("zero max_tokens", CH, _chat(max_tokens=0), 400, "max_tokens"),
    ("huge max_tokens", C, _completion(max_tokens=10**9), 400, "max_tokens"),
    ("max_tokens beyond int64", C, _completion(max_tokens=10**30), 400, "max_tokens"),
    ("huge max_completion_tokens", CH, _chat(max_completion_tokens=10**9), 400, None),
    ("negative temperature", C, _completion(temperature=-0.5), 400, "temperature"),
    ("negative temperature (chat)", CH, _chat(temperature=-1), 400, "temperature"),
    ("top_p 0", C, _completion(top_p=0), 400, "top_p"),
    ("top_p above 1", C, _completion(top_p=1.01), 400, "top_p"),
    ("negative top_p", CH, _chat(top_p=-0.5), 400, "top_p"),
    ("n 0", C, _completion(n=0), 400, "n"),
    ("n huge", C, _completion(n=10**6), 400, "n"),
    ("n huge (chat)", CH, _chat(n=10**6), 400, "n"),
    (
        "prompt longer than the context",
        C,
        {"prompt": [5] * (MAIN_MAX_MODEL_LEN + 1)},
        400,
        "prompt",
    ),
    ("text prompt longer than the context", C, {"prompt": "fox " * 2000}, 400, "prompt"),
    (
        "chat longer than the context",
        CH,
        {"messages": [{"role": "user", "content": "fox " * 2000}]},
        400,
        "messages[0].content",  # longer than any prompt of the context: refused untokenized
    ),
    ("empty prompt", C, {"prompt": ""}, 400, "prompt"),
    ("empty prompt list", C, {"prompt": []}, 400, "prompt"),
    ("empty prompt in a batch", C, {"prompt": ["hi", ""]}, 400, "prompt"),
    ("empty messages", CH, {"messages": []}, 400, "messages"),
    ("token id = vocabulary size", C, {"prompt": [1, VOCAB_SIZE]}, 400, "prompt"),
    ("token id far outside", C, {"prompt": [10**12]}, 400, "prompt"),
    ("negative token id", C, {"prompt": [-1]}, 400, "prompt"),
    ("stop token id outside", C, _completion(stop_token_ids=[VOCAB_SIZE]), 400, "stop_token_ids"),
    ("logit_bias id outside", C, _completion(logit_bias={str(VOCAB_SIZE): 1}), 400, "logit_bias"),
    ("unknown model", C, _completion(model="gpt-9"), 404, "model"),
    ("unknown model (chat)", CH, _chat(model="gpt-9"), 404, "model"),
    (
        "stop list of 1,000 strings",
        C,
        _completion(stop=[f"s{i}" for i in range(1000)]),
        400,
        "stop",
    ),
    ("stop list of 1,000 strings (chat)", CH, _chat(stop=["x"] * 1000), 400, "stop"),
    ("10 MB body", C, {"prompt": "x" * TEN_MB}, 413, None),
    ("negative timeout", C, _completion(timeout=-1), 400, "timeout"),
]


def _send(http: httpx.Client, url: str, path: str, body: object) -> httpx.Response:
    if isinstance(body, bytes):
        headers = {"Content-Type": "application/json"}
        return http.post(f"{url}{path}", content=body, headers=headers)
    return http.post(f"{url}{path}", json=body)


def _check_error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text[:500]
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if param is not None:
        assert error["param"] == param, error
    return error


class BackgroundStreams:
    """Greedy streams, one after another on a thread, until stopped; records each text."""

    def __init__(self, url: str, model: str) -> None:
        self.url = url
        self.body = completion_body(model, STREAM_PROMPT, STREAM_TOKENS)
        self.texts: list[str] = []
        self.event_times: list[float] = []
        self.errors: list[object] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._loop()))

    async def _loop(self) -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            while not self.stop.is_set():
                result = await stream_sse(http, self.url, self.body)
                if result.error is not None or not result.done:
                    self.errors.append(result)
                self.texts.append(result.text)
                self.event_times += result.event_times

    def events_between(self, start: float, end: float) -> int:
        return sum(1 for t in self.event_times if start <= t <= end)

    @classmethod
    @contextlib.contextmanager
    def running(cls, url: str, model: str) -> Iterator[BackgroundStreams]:
        streams = cls(url, model)
        streams.thread.start()
        try:
            yield streams
        finally:
            streams.stop.set()
            streams.thread.join(60)


def test_bad_inputs_get_4xx_while_streams_run(
    main_server: ServerProcess, model_name: str, figures: dict
) -> None:
    url = main_server.url
    (expected,) = greedy_alone(url, model_name, [STREAM_PROMPT], STREAM_TOKENS)
    codes: dict[int, int] = {}
    with BackgroundStreams.running(url, model_name) as streams, httpx.Client(timeout=60) as http:
        start = time.monotonic()
        for name, path, body, status, param in BAD_INPUTS:
            if isinstance(body, dict):
                body = {"model": model_name, **body}
            try:
                _check_error(_send(http, url, path, body), status, param)
            except AssertionError as e:
                raise AssertionError(f"{name}: {e}") from e
            codes[status] = codes.get(status, 0) + 1
        _check_error(_send_chunked(http, url, TEN_MB), 413, None)
        codes[413] += 1
    elapsed = time.monotonic() - start
    assert not streams.errors, streams.errors[:3]
    assert streams.texts and all(text == expected for text in streams.texts)
    wait_idle(url, timeout=10.0)
    figures["bad input: cases / answers / streams alongside, all exact"] = (
        f"{len(BAD_INPUTS) + 1} / {json.dumps(codes)} / {len(streams.texts)} in {elapsed:.1f} s"
    )


def _send_chunked(http: httpx.Client, url: str, size: int) -> httpx.Response:
    """A body without Content-Length (chunked), ``size`` bytes in 1 MB chunks."""

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(size // 1_000_000):
            yield b"x" * 1_000_000
        yield b'"}'

    headers = {"Content-Type": "application/json"}
    return http.post(f"{url}/v1/completions", content=chunks(), headers=headers)
