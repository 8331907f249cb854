"""The API process's handle on the engine process: spawn it (``EngineProcess``), send requests
and aborts, receive each step's outputs, and learn of its death at once (its sentinel is
watched on the event loop, so even a SIGKILL is noticed within a loop iteration). Messages: see
``core_proc``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

import zmq
import zmq.asyncio

from pagedserve.config import EngineConfig
from pagedserve.core.request import Request, RequestStatus
from pagedserve.engine.core_proc import (
    ABORT,
    ADD,
    DEAD,
    FINISH,
    READY,
    SHUTDOWN,
    STEP,
    EngineDeadError,
    EngineInfo,
    StepResult,
    build_engine_core,
    encode,
    run_engine_core,
)


class EngineProcess:
    """The spawned engine process and the API side's two bound sockets.

    Needs no event loop: the server spawns it before its own start-up work (imports, the
    model's config, the tokenizer), which then runs while the engine process imports and
    loads the model. ``EngineCoreClient`` talks to it from the event loop. The default
    ``core_factory`` imports the engine core in the engine process only.
    """

    def __init__(
        self, config: EngineConfig, core_factory: Callable[[EngineConfig], Any] = build_engine_core
    ) -> None:
        self._tmpdir = tempfile.mkdtemp(prefix="pagedserve-ipc-")
        input_addr = f"ipc://{self._tmpdir}/input"
        output_addr = f"ipc://{self._tmpdir}/output"
        self._ctx = zmq.asyncio.Context()  # its sockets find the event loop on first use
        self.input = self._ctx.socket(zmq.PUSH)
        self.input.bind(input_addr)
        self.output = self._ctx.socket(zmq.PULL)
        self.output.bind(output_addr)
        # Not daemonic: the engine may start worker processes of its own.
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(
                config,
                input_addr,
                output_addr,
                core_factory,
                logging.getLogger().getEffectiveLevel(),
            ),
            name="pagedserve-engine-core",
        )
        self.proc.start()
        self._closed = False

    def kill(self) -> None:
        """SIGKILL the engine process (a hung one may not answer SIGTERM)."""
        if self.proc.is_alive() and self.proc.pid is not None:
            os.kill(self.proc.pid, signal.SIGKILL)

    def close(self) -> None:
        """Stop the engine process (SIGTERM, then SIGKILL) and release sockets; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5.0)
        if self.proc.is_alive():
            self.kill()
            self.proc.join(5.0)
        self.input.close(linger=0)
        self.output.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)


class EngineCoreClient:
    """Talks to an ``EngineProcess``; lives on the API process's event loop.

    Construct it inside a running event loop. ``get_output`` raises ``EngineDeadError`` as soon
    as the engine process exits (its sentinel becomes readable) or reports a failure.
    """

    def __init__(self, engine: EngineProcess) -> None:
        self.engine = engine
        self._loop = asyncio.get_running_loop()
        self._dead: asyncio.Future[str] = self._loop.create_future()
        # An engine that died before this: its sentinel is readable, the callback runs at once.
        self._loop.add_reader(self.engine.proc.sentinel, self._on_process_exit)
        self._closed = False

    @property
    def pid(self) -> int | None:
        return self.engine.proc.pid

    @property
    def is_dead(self) -> bool:
        return self._dead.done()

    def _on_process_exit(self) -> None:
        self._loop.remove_reader(self.engine.proc.sentinel)
        self.engine.proc.join(timeout=0.5)  # it has exited: this only reaps it (and sets exitcode)
        self._mark_dead(f"engine process exited (exit code {self.engine.proc.exitcode})")

    def _mark_dead(self, reason: str) -> None:
        if not self._dead.done():
            self._dead.set_result(reason)

    async def wait_ready(self) -> EngineInfo:
        kind, payload = await self._recv()
        if kind != READY:
            raise EngineDeadError(f"engine process sent {kind!r} before READY")
        return payload

    async def get_output(self) -> StepResult:
        kind, payload = await self._recv()
        if kind != STEP:
            raise EngineDeadError(f"engine process sent unexpected message {kind!r}")
        outputs, stats, queue_times = payload
        return StepResult(outputs, stats, queue_times)

    async def _recv(self) -> tuple[bytes, Any]:
        if self._dead.done():
            raise EngineDeadError(self._dead.result())
        # zmq.asyncio returns a Future, typed as a plain Awaitable: ensure_future returns it.
        recv = asyncio.ensure_future(self.engine.output.recv_multipart())
        pending: set[asyncio.Future[Any]] = {recv, self._dead}
        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if recv not in done:
            recv.cancel()
            raise EngineDeadError(self._dead.result())
        kind, payload = recv.result()
        if kind == DEAD:
            # The engine process logged the whole traceback; its last line says what failed.
            last_line = pickle.loads(payload).strip().splitlines()[-1]
            reason = f"engine core failed: {last_line}"
            self._mark_dead(reason)
            raise EngineDeadError(reason)
        return kind, pickle.loads(payload)

    async def add_request(self, request: Request) -> None:
        await self._send(ADD, request)

    async def abort_requests(self, req_ids: Iterable[str]) -> None:
        await self._send(ABORT, list(req_ids))

    async def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> None:
        await self._send(FINISH, (list(req_ids), status))

    async def _send(self, kind: bytes, payload: object) -> None:
        """Send, or raise once the engine is dead: a PUSH socket whose peer is gone would
        wait for one forever."""
        if self._dead.done():
            raise EngineDeadError(self._dead.result())
        send = asyncio.ensure_future(
            self.engine.input.send_multipart((kind, encode(payload)), copy=False)
        )
        pending: set[asyncio.Future[Any]] = {send, self._dead}
        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if send not in done:
            send.cancel()
            raise EngineDeadError(self._dead.result())
        send.result()

    def kill(self) -> None:
        """SIGKILL the engine process; its sentinel then marks the client dead."""
        self.engine.kill()

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Ask the engine to stop, wait up to ``timeout`` s, then terminate it; idempotent."""
        if self._closed:
            return
        self._mark_dead("engine shut down")
        self._loop.remove_reader(self.engine.proc.sentinel)  # one reaper only: the join below
        if self.engine.proc.is_alive():
            # Without waiting: the engine may be exiting already (its socket closed).
            with contextlib.suppress(zmq.ZMQError):
                await self.engine.input.send_multipart((SHUTDOWN, b""), flags=zmq.NOBLOCK)
            await asyncio.to_thread(self.engine.proc.join, timeout)
        self.close()

    def close(self) -> None:
        """Stop the engine process (SIGTERM, then SIGKILL) and release sockets; synchronous."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self.engine.proc.sentinel)
        self._mark_dead("engine shut down")
        self.engine.close()
