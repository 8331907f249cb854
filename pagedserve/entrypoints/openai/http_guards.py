"""Connection-level defences of the HTTP server: slow or idle clients are cut, requests framed
two ways are refused, header blocks are bounded.

- ``GuardedH11Protocol`` (uvicorn's h11 protocol): a connection must complete its request line
  and headers within ``header_timeout`` s of connecting or of its previous response (a
  slowloris client trickling headers, or a socket that never sends, is closed).
- ``RequestGuard`` (ASGI middleware): a request with both ``Content-Length`` and
  ``Transfer-Encoding`` (the shape of request smuggling: a proxy in front may frame it the
  other way) is answered 400 and its connection closed; more than ``MAX_HEADERS`` headers
  or ``MAX_HEADER_BYTES`` of them, 431; a ``Host`` outside ``allowed_hosts``, 400 (a page
  that DNS-rebinds its own name to 127.0.0.1 cannot drive a keyless local server); a body that stalls for ``body_timeout`` s between two chunks, 408, connection closed.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus

import h11
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedserve.entrypoints.openai.errors import OpenAIError

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
MAX_HEADER_BYTES = 16 * 1024
"""The headers together: h11 refuses (400) a head still incomplete past this size
(``max_incomplete_event_size``), the guard (431) a complete one that is larger."""
MAX_HEADERS = 100
CLOSE = {"Connection": "close"}


def guarded_h11_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with ``header_timeout`` (uvicorn builds the instances)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout": header_timeout})


class GuardedH11Protocol(H11Protocol):
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()  # the next request's headers get the same time

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        """No complete request head since the timer was armed: close the connection."""
        self._header_timer = None
        waiting_for_head = self.conn.their_state is h11.IDLE and (
            self.cycle is None or self.cycle.response_complete
        )
        if waiting_for_head and not self.transport.is_closing():
            self.transport.close()


class BodyReadTimeoutError(StarletteHTTPException):
    """Raised while the body is read; the app's handler answers it in OpenAI's shape."""

    openai_code = "request_timeout"

    def __init__(self, timeout: float) -> None:
        super().__init__(
            HTTPStatus.REQUEST_TIMEOUT,
            detail=f"the request body stalled for {timeout:g} s (--body-timeout)",
            headers=CLOSE,
        )


LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})
"""The ``Host`` names a server bound to a loopback address accepts by default."""


def host_name(host_header: bytes) -> str:
    """``b"example.com:8000"`` -> ``"example.com"``; ``b"[::1]:8000"`` -> ``"[::1]"``."""
    host = host_header.decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _host_refusal(headers: list[tuple[bytes, bytes]], allowed: frozenset[str]) -> OpenAIError | None:
    for name, value in headers:
        if name == b"host" and host_name(value) not in allowed:
            return OpenAIError(
                HTTPStatus.BAD_REQUEST,
                f"Host {host_name(value)!r} is not one this server answers (--allowed-hosts)",
                code="invalid_host",
                headers=CLOSE,
            )
    return None


def _refusal(scope: Scope, allowed_hosts: frozenset[str] | None) -> OpenAIError | None:
    headers = scope.get("headers", [])
    if len(headers) > MAX_HEADERS:
        return OpenAIError(
            HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
            f"{len(headers)} headers is more than this server accepts ({MAX_HEADERS})",
            code="too_many_headers",
            headers=CLOSE,
        )
    size = sum(len(name) + len(value) + 4 for name, value in headers)  # ": " and CRLF
    if size > MAX_HEADER_BYTES:
        return OpenAIError(
            HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
            f"the headers take {size} bytes, more than this server accepts ({MAX_HEADER_BYTES})",
            code="headers_too_large",
            headers=CLOSE,
        )
    names = {name for name, _ in headers}
    if b"content-length" in names and b"transfer-encoding" in names:
        return OpenAIError(
            HTTPStatus.BAD_REQUEST,
            "a request may not have both Content-Length and Transfer-Encoding",
            code="invalid_request_framing",
            headers=CLOSE,
        )
    return None if allowed_hosts is None else _host_refusal(headers, allowed_hosts)


class RequestGuard:
    """ASGI middleware: the request framing, header and Host checks, and the body timeout.
    ``allowed_hosts`` None: any Host."""

    def __init__(
        self, app: ASGIApp, body_timeout: float, allowed_hosts: frozenset[str] | None = None
    ) -> None:
        self.app = app
        self.body_timeout = body_timeout
        self.allowed_hosts = allowed_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = _refusal(scope, self.allowed_hosts)
        if refusal is not None:
            await refusal.response()(scope, receive, send)
            return
        await self.app(scope, self._timed(receive), send)

    def _timed(self, receive: Receive) -> Receive:
        """``receive`` that raises a 408 if a body chunk takes over ``body_timeout`` s; once
        the body is complete it waits without limit (for the client's disconnect)."""
        body_done = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout)
            except TimeoutError:
                raise BodyReadTimeoutError(self.body_timeout) from None
            body_done = message["type"] != "http.request" or not message.get("more_body")
            return message

        return timed_receive
