"""The connection-level guards, on uvicorn in this process (a small app, short timeouts):
idle and slow clients are cut, requests framed two ways are refused and their connection
closed, header blocks are bounded, connections past the cap are refused in OpenAI's shape
(here and on a real server)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request

from pagedserve.entrypoints.openai.connection_cap import ConnectionCap
from pagedserve.entrypoints.openai.errors import install_error_handlers
from pagedserve.entrypoints.openai.http_guards import (
    MAX_HEADER_BYTES,
    MAX_HEADERS,
    RequestGuard,
    guarded_h11_protocol,
)
from tests.entrypoints.openai.server_utils import (
    SHARED_SERVER_MAX_CONNECTIONS,
    ServerProcess,
    free_port,
)

TIMEOUT_S = 0.5
MAX_CONNECTIONS = 4
WAIT_S = 5.0
"""Longest any socket read here waits (a hang fails the test instead of blocking it)."""


def _app(open_connections: Callable[[], int]) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(RequestGuard, body_timeout=TIMEOUT_S)
    app.add_middleware(
        ConnectionCap, max_connections=MAX_CONNECTIONS, open_connections=open_connections
    )

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    return app


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    port = free_port()
    servers: list[uvicorn.Server] = []
    config = uvicorn.Config(
        _app(lambda: len(servers[0].server_state.connections)), host="127.0.0.1", port=port,
        log_level="critical", http=guarded_h11_protocol(TIMEOUT_S),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )
    server = uvicorn.Server(config)
    servers.append(server)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield port
    server.should_exit = True
    thread.join(WAIT_S)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    sock.settimeout(WAIT_S)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _request(body: bytes = b"{}", extra: bytes = b"") -> bytes:
    return (b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body)


@pytest.mark.serial  # sleeps just under the header timeout
def test_keep_alive_requests_are_served(port):
    with _connect(port) as sock:
        for _ in range(2):
            sock.sendall(_request(b'{"a": 1}'))
            answer = b""
            while not answer.endswith(b"}"):
                answer += sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"bytes":8}')
            time.sleep(TIMEOUT_S * 0.6)  # twice, longer than the header timeout in total


@pytest.mark.serial  # timed against the header timeout
def test_idle_connection_is_closed(port):
    with _connect(port) as sock:
        start = time.monotonic()
        assert _read_all(sock) == b""
        assert TIMEOUT_S * 0.9 < time.monotonic() - start < WAIT_S


@pytest.mark.serial  # timed against the header timeout
def test_trickled_headers_are_cut(port):
    with _connect(port) as sock:
        start = time.monotonic()
        with pytest.raises(OSError):  # broken pipe or reset, once the server closed
            for byte in _request():
                sock.sendall(bytes([byte]))
                time.sleep(0.05)
        assert time.monotonic() - start < WAIT_S


@pytest.mark.serial  # timed against the body timeout
def test_stalled_body_is_a_408_and_closed(port):
    with _connect(port) as sock:
        sock.sendall(_request(b"x" * 100)[:-90])
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer


def test_content_length_with_transfer_encoding_is_refused_and_closed(port):
    smuggled = b"GET /docs HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with _connect(port) as sock:
        sock.sendall(_request(b"0\r\n\r\n", b"Transfer-Encoding: chunked\r\n") + smuggled)
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 400") and b"invalid_request_framing" in answer
    assert answer.count(b"HTTP/1.1") == 1  # the trailing request never ran


def test_header_count_and_size_are_bounded(port):
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(MAX_HEADERS + 1))
    with _connect(port) as sock:
        sock.sendall(_request(extra=many))
        assert _read_all(sock).startswith(b"HTTP/1.1 431")
    huge = b"X-Big: " + b"v" * MAX_HEADER_BYTES + b"\r\n"
    with _connect(port) as sock:
        sock.sendall(_request(extra=huge))  # at once: complete, refused by the guard
        assert _read_all(sock).startswith(b"HTTP/1.1 431")
    with _connect(port) as sock:
        sock.sendall(_request(extra=huge + huge)[: 2 * MAX_HEADER_BYTES])  # incomplete: by h11
        assert _read_all(sock).startswith(b"HTTP/1.1 400")


def _refused_past_the_cap(port: int, max_connections: int) -> None:
    """With ``max_connections`` idle connections open, a request on one more gets OpenAI's
    503 naming the limit, and its connection is closed; once they close, it is served."""
    idle = [_connect(port) for _ in range(max_connections)]
    try:
        time.sleep(0.1)
        with _connect(port) as sock:
            sock.sendall(_request())
            answer = _read_all(sock)
    finally:
        for sock in idle:
            sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower(), head
    error = json.loads(body)["error"]
    assert error["code"] == "server_overloaded" and error["type"] == "service_unavailable_error"
    assert f"{max_connections} connections (--max-connections)" in error["message"], error
    time.sleep(0.1)
    with _connect(port) as sock:
        sock.sendall(_request())
        assert not sock.recv(65536).startswith(b"HTTP/1.1 503")


def test_connections_past_the_cap_are_refused(port):
    _refused_past_the_cap(port, MAX_CONNECTIONS)


def test_real_server_refuses_connections_past_the_cap(server: ServerProcess):
    _refused_past_the_cap(server.port, SHARED_SERVER_MAX_CONNECTIONS)


def test_real_server_refuses_two_framings(server: ServerProcess):
    with _connect(server.port) as sock:
        sock.sendall(_request(b"0\r\n\r\n", b"Transfer-Encoding: chunked\r\n")
                     + b"GET /version HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 400") and answer.count(b"HTTP/1.1") == 1
