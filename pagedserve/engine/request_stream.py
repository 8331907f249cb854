"""RequestStream: one submitted request's outputs on the API process's event loop, and the
errors that can end a request before it finishes.

A stream ends in one of four ways: its last output (finished), an error put on it by its
engine (engine death, server shutdown), its deadline passing (the client's ``timeout``), or
``close()`` by its consumer. Every way but the first leaves the request to be aborted in the
engine core, so its KV blocks are freed: a timed-out or closed stream aborts it itself, and the
engine aborts the requests it fails.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from pagedserve.engine.input_processor import ProcessedRequest
from pagedserve.outputs import RequestOutput


class EngineNotReadyError(RuntimeError):
    """The engine process is still loading the model."""


class EngineOverloadedError(RuntimeError):
    """More requests wait for their first token than ``max_waiting_requests`` allows."""


class ServerShuttingDownError(RuntimeError):
    """The server is draining (SIGTERM): it takes no new request, and an in-flight request that
    did not finish within the shutdown timeout ends with this error."""


class RequestTimeoutError(RuntimeError):
    """The request ran past the ``timeout`` its client asked for (counted from its arrival,
    queueing included); it was aborted."""

    def __init__(self, timeout: float) -> None:
        super().__init__(
            f"timeout: the request did not finish within its timeout of {timeout:g} s "
            "and was aborted"
        )
        self.timeout = timeout


class StreamOwner(Protocol):
    """What a stream needs from its engine (``AsyncLLM``)."""

    def forget(self, request_id: str) -> None: ...

    def abort_nowait(self, request_id: str) -> None: ...


class RequestStream:
    """One submitted request's outputs, in order; iterate it, and ``close()`` it when done.

    Closing a stream whose request has not finished aborts the request in the engine core.
    With a ``timeout`` (seconds from the request's arrival), iterating past the deadline
    aborts the request and raises ``RequestTimeoutError``.
    """

    def __init__(
        self, owner: StreamOwner, processed: ProcessedRequest, timeout: float | None = None
    ) -> None:
        self.owner = owner
        self.request_id = processed.request_id
        self.child_ids = [r.request_id for r in processed.requests]
        self.arrival_time = processed.arrival_time
        self.timeout = timeout
        self.deadline = None if timeout is None else processed.arrival_time + timeout
        """``time.monotonic()`` past which the request is aborted; None: no limit."""
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.last_token_time: float | None = None
        self.done = False
        """The request finished, failed, or was closed: nothing more will be read."""

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        item = await self._next_item()
        if isinstance(item, BaseException):
            self.done = True
            raise item
        self.done = item.finished
        return item

    async def _next_item(self) -> RequestOutput | BaseException:
        if self.deadline is None or not self.queue.empty():
            return await self.queue.get()
        try:
            return await asyncio.wait_for(
                self.queue.get(), max(0.0, self.deadline - time.monotonic())
            )
        except TimeoutError:
            assert self.timeout is not None
            self.close()  # aborts the request: it has not finished
            return RequestTimeoutError(self.timeout)

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` (its consumer raises it after the outputs before it)."""
        self.queue.put_nowait(error)

    def close(self) -> None:
        if self.done:
            self.owner.forget(self.request_id)
        else:
            self.done = True
            self.owner.abort_nowait(self.request_id)
