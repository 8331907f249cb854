"""``--enable-request-id-headers`` (vLLM's option): every HTTP response carries ``X-Request-Id``,
the client's own when it sent one, else a new random id, so a proxy or a client can match a
response to its request in logs. A pure ASGI middleware: streamed responses pass through."""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"


class RequestIdHeader:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = dict(scope["headers"]).get(HEADER) or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (HEADER, request_id)]
            await send(message)

        await self.app(scope, receive, send_with_id)
