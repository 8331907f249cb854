"""A request-body size limit (``--max-request-body-bytes``): a larger body is answered 413 in
OpenAI's error shape before it is parsed, so one huge request cannot take the server's memory.

A body with a ``Content-Length`` over the limit is refused at once; its bytes are read and
dropped (up to ``DISCARD_LIMIT``) so the client, still sending, reads the answer instead of a
reset connection. A chunked body is counted as it arrives and refused once it passes the limit.
"""

from __future__ import annotations

from http import HTTPStatus

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve.entrypoints.openai.errors import OpenAIError

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024
DISCARD_LIMIT = 64 * 1024 * 1024
"""Most bytes of a refused body read and dropped before answering (then the connection closes)."""


TOO_LARGE_CODE = "request_too_large"


def _too_large_message(size: int | None, max_bytes: int) -> str:
    what = "request body" if size is None else f"request body of {size} bytes"
    return f"{what} is over the server's limit of {max_bytes} bytes (--max-request-body-bytes)"


class BodyTooLargeError(StarletteHTTPException):
    """Raised while the body is read; the app's handler answers it in OpenAI's shape."""

    openai_code = TOO_LARGE_CODE

    def __init__(self, max_bytes: int) -> None:
        super().__init__(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE, detail=_too_large_message(None, max_bytes)
        )


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server (h11) refuses a malformed length before us
    return None


class BodySizeLimit:
    """ASGI middleware: HTTP request bodies of at most ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_request_body_bytes: must be positive, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _discard_body(receive)
            error = OpenAIError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                _too_large_message(declared, self.max_bytes),
                code=TOO_LARGE_CODE,
            )
            await error.response()(scope, receive, send)
            return
        await self.app(scope, self._counting(receive), send)

    def _counting(self, receive: Receive) -> Receive:
        """``receive`` that raises a 413 (handled by the app's error handlers, in OpenAI's
        shape) once more than ``max_bytes`` of body have arrived."""
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLargeError(self.max_bytes)
            return message

        return limited_receive


async def _discard_body(receive: Receive) -> None:
    read = 0
    while read <= DISCARD_LIMIT:
        message = await receive()
        if message["type"] != "http.request":
            return  # the client went away
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
