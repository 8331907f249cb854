"""One tensor-parallel rank: its process group, its ModelRunner, and the step protocol.

The driver (an executor in the engine process) sends calls, each a pickled
``(method, args)``; every rank runs the same calls in the same order, so their collectives
meet. Replies are ``("ok", result)`` or ``("error", exception, traceback text)``.

Step protocol: a step runs ``execute_model`` and, when tokens were scheduled, samples on
every rank (sampling updates every rank's slots the same way). Only rank 0 replies to a
step, with the sampled tokens (None for a step without tokens); the other ranks reply to
start-up calls only, so a step costs one message out per rank and one back.

A process worker waits for a step's tokens only once nothing else is queued: with async
scheduling the engine sends step N+1 before it waits for step N, and the worker launches
N+1 before it waits for N's tokens (as ``EngineCore`` does with one in-process runner).
"""

from __future__ import annotations

import pickle
import signal
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from pagedserve.config import EngineConfig
from pagedserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.distributed.executor import PendingOutput
from pagedserve.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from pagedserve.platform import platform_for
from pagedserve.worker.model_runner import ModelRunner

STEP = "execute_step"
SHUTDOWN = "shutdown"
CALLS = ("load_model", "determine_num_blocks", "initialize_kv_cache", "capture_graphs", STEP)
"""The methods a driver may call on a worker (besides SHUTDOWN)."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a rank needs to start: the engine config (device and dtype resolved), its place
    in the group, and where the group meets (``tcp://host:port``)."""

    config: EngineConfig
    rank: int
    world_size: int
    local_rank: int
    """Index of this rank's GPU among the GPUs its process sees."""
    init_method: str


@dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know about a rank's model after loading."""

    hf_config: Any
    max_model_len: int
    dtype: torch.dtype
    device: torch.device


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.rank = spec.rank
        # cuda -> this rank's GPU, made current; cpu: the ranks share the host's cores.
        self.device = platform_for(spec.config.device).rank_device(spec.local_rank)
        platform_for(self.device).configure_rank(spec.world_size)
        self.tp_group = init_tensor_parallel(
            spec.rank, spec.world_size, spec.init_method, self.device
        )
        self.model_runner = ModelRunner(spec.config, self.device)

    def load_model(self) -> ModelInfo:
        runner = self.model_runner
        runner.load_model()  # builds this rank's shard (load_model reads get_tp_group())
        return ModelInfo(runner.hf_config, int(runner.max_model_len), runner.dtype, self.device)

    def determine_num_blocks(self) -> int:
        return self.model_runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def capture_graphs(self) -> None:
        self.model_runner.capture_graphs()

    def launch_step(self, scheduler_output: SchedulerOutput) -> PendingOutput | None:
        """Queue the step's work on the device; None when no tokens were scheduled."""
        self.model_runner.execute_model(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return None
        return self.model_runner.sample_tokens_async()

    def finish_step(self, pending: PendingOutput | None) -> ModelRunnerOutput | None:
        """Wait for a launched step; its tokens on rank 0, None elsewhere."""
        output = None if pending is None else pending.get_output()
        return output if self.rank == 0 else None

    def execute_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.finish_step(self.launch_step(scheduler_output))

    def call(self, method: str, args: tuple) -> Any:
        if method not in CALLS:
            raise ValueError(f"worker call: {method!r} is not one of {', '.join(CALLS)}")
        return getattr(self, method)(*args)

    def shutdown(self) -> None:
        destroy_tensor_parallel()


def error_reply(exc: BaseException) -> tuple[str, BaseException, str]:
    """("error", the exception or a picklable stand-in, its traceback text)."""
    text = "".join(traceback.format_exception(exc))
    try:
        pickle.dumps(exc)
    except Exception:  # an exception type that does not pickle (custom __init__)
        exc = RuntimeError(f"{type(exc).__name__}: {exc}")
    return "error", exc, text


class _StepReplies:
    """The launched step whose tokens are not yet waited for (at most one)."""

    def __init__(self, worker: Worker, conn: Connection) -> None:
        self.worker = worker
        self.conn = conn
        self.launched = False
        self.pending: PendingOutput | None = None

    def launch(self, scheduler_output: SchedulerOutput) -> None:
        """Launch a step, then finish the one before it (the device already has work)."""
        pending = self.worker.launch_step(scheduler_output)
        self.flush()
        self.launched, self.pending = True, pending

    def flush(self) -> None:
        if not self.launched:
            return
        output = self.worker.finish_step(self.pending)
        self.launched, self.pending = False, None
        if self.worker.rank == 0:  # the only rank that answers steps
            self.conn.send(("ok", output))


def _serve(worker: Worker, conn: Connection) -> None:
    steps = _StepReplies(worker, conn)
    while True:
        if not conn.poll():  # nothing queued: the engine may be waiting for the last step
            steps.flush()
        method, args = pickle.loads(conn.recv_bytes())
        if method == STEP:
            steps.launch(*args)
            continue
        steps.flush()
        if method == SHUTDOWN:
            worker.shutdown()
            conn.send(("ok", None))
            return
        conn.send(("ok", worker.call(method, args)))


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of a worker process (``mp`` backend). Ends when the driver says so or its
    end of the pipe closes (the engine process is gone); a failure is reported on the pipe,
    then the process exits with status 1."""
    # Ctrl-C reaches the whole process group; the engine decides when its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        worker = Worker(spec)
        conn.send(("ok", None))
        _serve(worker, conn)
    except (EOFError, BrokenPipeError):
        return  # the driver is gone: nobody to report to
    except BaseException as e:
        try:
            conn.send(error_reply(e))
        except (BrokenPipeError, OSError):
            pass
        sys.exit(1)
