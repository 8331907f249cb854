"""What went wrong when a worker process stopped answering: which rank, and how.

When one rank dies, the others soon fail in their collectives (gloo reports the closed
connection; NCCL may hang). The rank that died without a word is the cause, so it is named
first; ranks that reported an exception follow. Then every worker is stopped.
"""

from __future__ import annotations

import signal
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import NoReturn

from pagedserve.distributed.executor import WorkerError

GRACE_S = 1.0
"""How long to let the other ranks die or report before the error is composed."""


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


def _read_errors(conns: list[Connection], reported: dict[int, list]) -> None:
    """Add the error replies waiting on the pipes to ``reported`` (rank -> [exc, traceback])."""
    for rank, conn in enumerate(conns):
        if rank in reported:
            continue
        try:
            while conn.poll():
                status, *payload = conn.recv()
                if status == "error":
                    reported[rank] = payload
                    break
        except (EOFError, OSError):
            continue


def _silent_deaths(processes: list[BaseProcess], reported: dict[int, list]) -> list[int]:
    return [r for r, p in enumerate(processes) if not p.is_alive() and r not in reported]


def kill_all(processes: list[BaseProcess]) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(5.0)


def raise_worker_error(
    processes: list[BaseProcess],
    conns: list[Connection],
    what: str,
    reported: dict[int, list],
) -> NoReturn:
    """Stop every worker process and raise ``worker_failure``'s exception; first let the
    other ranks die or report for up to ``GRACE_S``, so the rank that died is named."""
    deadline = time.monotonic() + GRACE_S
    while True:
        _read_errors(conns, reported)
        if _silent_deaths(processes, reported) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    dead = {
        r: f"(pid {processes[r].pid}) {describe_exit(processes[r].exitcode)}"
        for r in _silent_deaths(processes, reported)
    }
    kill_all(processes)
    raise worker_failure(what, dead, {r: (e, text) for r, (e, text) in reported.items()})


def worker_failure(
    what: str, dead: dict[int, str], reported: dict[int, tuple[BaseException, str]]
) -> BaseException:
    """The exception for the engine: ``WorkerError`` naming the ranks that died (rank ->
    how), or, when ranks only reported exceptions, the lowest rank's exception with a note
    naming the rank and carrying the worker's traceback (a ValueError stays a ValueError)."""
    if dead or not reported:
        lines = [f"tensor-parallel worker rank {r} {how} during {what}" for r, how in dead.items()]
        lines = lines or [f"tensor-parallel workers stopped answering during {what}"]
        lines += [
            f"rank {r} then failed: {type(e).__name__}: {e}" for r, (e, _) in reported.items()
        ]
        return WorkerError("; ".join(lines))
    rank = min(reported)
    exc, text = reported[rank]
    exc.add_note(f"raised in tensor-parallel worker rank {rank} during {what}:\n{text}")
    return exc
