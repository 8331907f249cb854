"""The multiprocess executor: one worker process per tensor-parallel rank on this host.

Workers are started with the ``spawn`` context (a fresh interpreter: no CUDA state copied
from the engine process) and each holds one end of a pipe. A call is pickled once and its
bytes sent down every pipe; a step is one such broadcast of the ``SchedulerOutput``, and only
rank 0 answers it (see ``worker_proc``).

Failure handling: every wait for a reply also watches every worker's process sentinel, so a
worker that dies (killed, crashed, or exited after reporting an error) ends the wait at
once with a ``WorkerError`` naming its rank, instead of a hang in the others' collectives.
"""

from __future__ import annotations

import multiprocessing
import pickle
import time
import weakref
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, NoReturn

from pagedserve.config import EngineConfig
from pagedserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.distributed.executor import (
    PendingOutput,
    WorkerGroupExecutor,
    require_mask_in_plan,
)
from pagedserve.distributed.parallel_state import free_port
from pagedserve.distributed.worker_proc import SHUTDOWN, STEP, WorkerSpec, worker_main
from pagedserve.distributed.worker_watch import kill_all, raise_worker_error
from pagedserve.platform import platform_for

if TYPE_CHECKING:
    from pagedserve.structured_output.bitmask import GrammarBitmask

SHUTDOWN_TIMEOUT_S = 5.0


class _StepReply:
    """Rank 0's answer to step ``index``, read from its pipe when asked for."""

    def __init__(self, executor: MultiprocExecutor, index: int) -> None:
        self.executor = executor
        self.index = index

    def get_output(self) -> ModelRunnerOutput:
        output = self.executor.step_output(self.index)
        return ModelRunnerOutput.empty() if output is None else output


class MultiprocExecutor(WorkerGroupExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        size = self.tensor_parallel_size
        max_ranks = platform_for(config.device).max_ranks()
        if max_ranks is not None and max_ranks < size:
            raise ValueError(
                f"tensor_parallel_size: {size} needs {size} GPUs, this host has {max_ranks}")
        context = multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.processes: list[BaseProcess] = []
        self.conns: list[Connection] = []
        for rank in range(size):
            spec = WorkerSpec(config, rank, size, rank, init_method)
            parent_end, child_end = context.Pipe(duplex=True)
            process = context.Process(
                target=worker_main, args=(spec, child_end), name=f"pagedserve-tp{rank}",
                daemon=True,
            )  # fmt: skip
            process.start()
            child_end.close()  # the worker's end lives in the worker only: EOF when it exits
            self.processes.append(process)
            self.conns.append(parent_end)
        self._finalizer = weakref.finalize(self, _stop, self.processes, self.conns)
        self._steps_sent = 0
        self._replies_read = 0
        self._outputs: dict[int, ModelRunnerOutput | None] = {}
        for rank in range(size):
            self._receive(rank, "start-up")  # each worker answers once it joined the group

    # ---- calls --------------------------------------------------------------------------------

    def _broadcast(self, method: str, *args: Any) -> None:
        data = pickle.dumps((method, args))  # pickled once, whatever the number of ranks
        for conn in self.conns:
            try:
                conn.send_bytes(data)
            except OSError:  # the worker's end is closed: it is gone
                self._fail(method)

    def _receive(self, rank: int, what: str) -> Any:
        """The next reply of ``rank``; as soon as any worker dies or fails instead, every
        worker is stopped and the error raised (``worker_watch``)."""
        conn = self.conns[rank]
        ready = wait([conn, *(p.sentinel for p in self.processes)])
        if conn not in ready:  # a process ended
            self._fail(what)
        try:
            status, *payload = conn.recv()
        except (EOFError, OSError):
            self._fail(what)
        if status != "ok":
            self._fail(what, {rank: payload})
        return payload[0]

    def _fail(self, what: str, reported: dict[int, list] | None = None) -> NoReturn:
        raise_worker_error(self.processes, self.conns, what, reported or {})

    def _collect(self, method: str, *args: Any) -> list[Any]:
        """Run ``method`` on every rank; their results in rank order."""
        self._broadcast(method, *args)
        return [self._receive(rank, method) for rank in range(len(self.conns))]

    # ---- steps --------------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self._broadcast(STEP, scheduler_output)
        self._steps_sent += 1

    def sample_tokens_async(self, grammar_bitmask: GrammarBitmask | None = None) -> PendingOutput:
        require_mask_in_plan(grammar_bitmask)  # a mask went with the plan
        return _StepReply(self, self._steps_sent - 1)

    def step_output(self, index: int) -> ModelRunnerOutput | None:
        """Rank 0's reply to step ``index``; replies are read in order, older ones dropped."""
        while self._replies_read <= index:
            self._outputs[self._replies_read] = self._receive(0, "execute_model")
            self._replies_read += 1
        for old in [i for i in self._outputs if i < index]:
            del self._outputs[old]
        return self._outputs.pop(index)

    def shutdown(self) -> None:
        self._finalizer()


def _stop(processes: list[BaseProcess], conns: list[Connection]) -> None:
    """Ask every live worker to stop; kill the ones still running after the timeout (a rank
    stuck in a collective whose peer is gone never reads the request)."""
    data = pickle.dumps((SHUTDOWN, ()))
    for process, conn in zip(processes, conns, strict=True):
        if process.is_alive():
            try:
                conn.send_bytes(data)
            except OSError:
                pass
    deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    kill_all(processes)
    for conn in conns:
        conn.close()
