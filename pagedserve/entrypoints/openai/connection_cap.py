"""``--max-connections``: past the cap, a request is answered 503 in OpenAI's error shape.

``ConnectionCap`` (ASGI middleware, the outermost) counts the requests in progress itself and
asks the server how many connections are open (idle keep-alive ones included: each holds a
file descriptor). A request that arrives while more than ``max_connections`` connections are
open (its own included), or while ``max_connections`` requests are already in progress, is
refused with 503 ``server_overloaded`` naming the limit, and its connection is closed so the
refusal frees a slot.
"""

from __future__ import annotations

from collections.abc import Callable
from http import HTTPStatus

from starlette.types import ASGIApp, Receive, Scope, Send

from pagedserve.entrypoints.openai.errors import OpenAIError

DEFAULT_MAX_CONNECTIONS = 512
RETRY_AFTER_S = 1


class ConnectionCap:
    def __init__(
        self, app: ASGIApp, max_connections: int, open_connections: Callable[[], int]
    ) -> None:
        self.app = app
        self.max_connections = max_connections
        self.open_connections = open_connections
        self.in_progress = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal()
        if refusal is not None:
            await refusal.response()(scope, receive, send)
            return
        self.in_progress += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_progress -= 1

    def _refusal(self) -> OpenAIError | None:
        connections = self.open_connections()
        if connections <= self.max_connections and self.in_progress < self.max_connections:
            return None
        what = (f"{connections} connections are open" if connections > self.max_connections
                else f"{self.in_progress} requests are in progress")
        return OpenAIError(
            HTTPStatus.SERVICE_UNAVAILABLE,
            f"the server is at its limit of {self.max_connections} connections "
            f"(--max-connections): {what}; retry later",
            code="server_overloaded",
            headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"},
        )
