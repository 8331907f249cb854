"""The engine core in its own process: the loop, and the messages it exchanges with the API
process (whose side is ``core_client.EngineCoreClient``).

Two ZeroMQ PUSH/PULL pipes over ``ipc://`` sockets in a private temporary folder::

    API process  --ADD / ABORT / FINISH / SHUTDOWN-->  engine process
    API process  <--READY / STEP / DEAD--------------  engine process

A message is two frames: a one-byte type and a pickle (protocol 5) payload. The engine process
runs a plain loop: while it has work it drains its input without blocking, steps, and sends one
STEP message (outputs, scheduler stats, queue times); when idle it blocks on its input socket
(and on its parent's sentinel, so it exits when the API process dies).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import pickle
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from pagedserve.config import EngineConfig
from pagedserve.core.request import Request
from pagedserve.core.sched_output import EngineCoreOutput

logger = logging.getLogger(__name__)

# Message types (first frame).
ADD, ABORT, FINISH, SHUTDOWN = b"A", b"X", b"F", b"S"
READY, STEP, DEAD = b"R", b"O", b"D"


class EngineDeadError(RuntimeError):
    """The engine process has exited; no request can be served any more."""


@dataclass
class EngineInfo:
    """What the engine process reports once its model is loaded."""

    max_model_len: int
    vocab_size: int


@dataclass
class StepResult:
    """One engine-loop iteration, as the API process receives it."""

    outputs: list[EngineCoreOutput]
    stats: Any
    """The core's ``get_stats()`` after the iteration (a ``SchedulerStats``)."""
    queue_times: list[float] = field(default_factory=list)
    """Seconds from arrival to first scheduling of the requests first scheduled this iteration."""


def encode(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=5)


class EngineCoreProc:
    """The engine process's loop around one core: input socket in, output socket out."""

    def __init__(
        self,
        core: Any,
        input_socket: zmq.Socket,
        output_socket: zmq.Socket,
        parent_sentinel: int | None,
    ) -> None:
        self.core = core
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.poller = zmq.Poller()
        self.poller.register(input_socket, zmq.POLLIN)
        self.parent_sentinel = parent_sentinel
        if parent_sentinel is not None:
            self.poller.register(parent_sentinel, zmq.POLLIN)
        self.unscheduled: dict[str, Request] = {}
        """Requests added but not yet scheduled (for their queue time)."""
        self.pending_outputs: list[EngineCoreOutput] = []
        """Outputs of aborts, finishes and refused requests, sent with the next STEP."""

    def run(self) -> None:
        """Serve until SHUTDOWN or until the parent process is gone."""
        while True:
            busy = self.core.has_unfinished_requests()
            events = dict(self.poller.poll(0 if busy else None))
            if self.parent_sentinel is not None and self.parent_sentinel in events:
                logger.warning("API process is gone; engine process exits")
                return
            if self.input_socket in events and not self._drain_inputs():
                return
            outputs, self.pending_outputs = self.pending_outputs, []
            if self.core.has_unfinished_requests():
                outputs += self.core.step()
            self._send(STEP, (outputs, self.core.get_stats(), self._pop_queue_times()))

    def _drain_inputs(self) -> bool:
        """Apply every pending message; False once SHUTDOWN arrives."""
        while True:
            try:
                kind, payload = self.input_socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if kind == SHUTDOWN:
                return False
            self._apply(kind, pickle.loads(payload))

    def _apply(self, kind: bytes, payload: Any) -> None:
        if kind == ADD:
            self._add(payload)
        elif kind == ABORT:
            self.pending_outputs += self.core.abort_requests(payload) or []
            for req_id in payload:
                self.unscheduled.pop(req_id, None)
        elif kind == FINISH:
            req_ids, status = payload
            self.pending_outputs += self.core.finish_requests(req_ids, status) or []
            for req_id in req_ids:
                self.unscheduled.pop(req_id, None)
        else:
            raise ValueError(f"engine input: unknown message type {kind!r}")

    def _add(self, request: Request) -> None:
        """A request the core refuses (its checks raise ValueError) ends as aborted; the
        engine keeps serving the others."""
        try:
            self.core.add_request(request)
        except ValueError as e:
            logger.error("engine refused request %s: %s", request.request_id, e)
            self.pending_outputs.append(
                EngineCoreOutput(request.request_id, [], finish_reason="abort")
            )
            return
        self.unscheduled[request.request_id] = request

    def _pop_queue_times(self) -> list[float]:
        times = []
        for req_id, req in list(self.unscheduled.items()):
            if req.first_scheduled_time is not None:
                times.append(max(0.0, req.first_scheduled_time - req.arrival_time))
                del self.unscheduled[req_id]
            elif req.is_finished:
                del self.unscheduled[req_id]
        return times

    def _send(self, kind: bytes, payload: object) -> None:
        self.output_socket.send_multipart((kind, encode(payload)), copy=False)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _send_death(output_socket: zmq.Socket, reason: str) -> None:
    with contextlib.suppress(zmq.Again):  # never block here: the API process may be gone
        output_socket.send_multipart((DEAD, encode(reason)), flags=zmq.NOBLOCK)


def build_engine_core(config: EngineConfig) -> Any:
    """The engine process's core. Imported here, in the engine process: the API process can
    spawn the engine before it imports torch itself."""
    from pagedserve.engine.core import EngineCore

    return EngineCore(config)


def run_engine_core(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    core_factory: Callable[[EngineConfig], Any],
    log_level: int,
) -> None:
    """Entry point of the spawned engine process (which starts with logging unconfigured)."""
    logging.basicConfig(
        level=log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s",
    )
    # Ctrl-C reaches the whole process group; the API process decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    ctx = zmq.Context()
    output_socket = ctx.socket(zmq.PUSH)
    output_socket.connect(output_addr)
    input_socket = ctx.socket(zmq.PULL)
    input_socket.connect(input_addr)
    parent = multiprocessing.parent_process()
    exit_code = 0
    try:
        core = core_factory(config)
        output_socket.send_multipart(
            (READY, encode(EngineInfo(core.max_model_len, core.vocab_size)))
        )
        EngineCoreProc(core, input_socket, output_socket, parent.sentinel if parent else None).run()
    except SystemExit:
        pass
    except (ValueError, MemoryError) as e:  # a bad model or config, too little memory: the
        # message names the cause; the API process prints it as one line
        logger.debug("engine core failed", exc_info=True)
        _send_death(output_socket, str(e))
        exit_code = 1
    except BaseException:  # noqa: BLE001 - any failure must reach the API process
        text = traceback.format_exc()
        logger.error("engine core failed:\n%s", text)
        _send_death(output_socket, text)
        exit_code = 1
    finally:
        output_socket.close(linger=1000)
        input_socket.close(linger=0)
        ctx.term()
    sys.exit(exit_code)
