"""A real ``pagedserve serve`` process on 127.0.0.1, and reading its ``/metrics``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[3]
API_KEY = "test-key"
MAX_MODEL_LEN = 4096
STARTUP_TIMEOUT_S = 180.0
SHARED_SERVER_MAX_CONNECTIONS = 100
"""The shared server's --max-connections: above any test's concurrency."""


_given_ports: set[int] = set()


def free_port() -> int:
    """A port free now, which the caller binds later (a server starting takes seconds).

    Not one this process gave before, whose server may not have bound it yet; and under
    pytest-xdist, one of this worker's share, so that two workers never pick the same port:
    ``port // 2`` modulo the workers is the worker's index (Linux gives ``bind`` odd ports)."""
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port // 2 % workers == index and port not in _given_ports:
            _given_ports.add(port)
            return port


class ServerProcess:
    """``python -m pagedserve.entrypoints.cli serve MODEL ...`` as a child process."""

    def __init__(self, model_dir: Path, log_path: Path, *extra_args: str,
                 env: Mapping[str, str] | None = None, port: int | None = None) -> None:
        """``port``: None takes a free one; 0 lets the system choose, and ``port`` / ``url``
        are read from the start-up banner once it is printed."""
        self.port = free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.health_statuses: list[int] = []
        """/health answers seen while waiting for the server (503 while the model loads)."""
        cmd = [
            sys.executable,
            "-m",
            "pagedserve.entrypoints.cli",
            "serve",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--log-level",
            "warning",
            *extra_args,
        ]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRITON_INTERPRET="1", PYTHONUNBUFFERED="1",
                   **(env or {}))
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self) -> None:
        self.wait_for_health(200)

    def wait_for_health(self, status: int) -> None:
        """Poll /health until it answers ``status`` (200: ready; 503: listening while the model
        loads)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            if self.port == 0 and not self._read_port_from_banner():
                time.sleep(0.05)
                continue
            try:
                answer = httpx.get(f"{self.url}/health", timeout=5).status_code
                self.health_statuses.append(answer)
                if answer == status:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"/health not {status} after {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    def _read_port_from_banner(self) -> bool:
        """Sets ``port`` and ``url`` from ``pagedserve: serving ... on http://HOST:PORT``."""
        banner = next((line for line in self.log().splitlines() if " serving " in line), None)
        if banner is None:
            return False
        self.url = banner.split(" on ", 1)[1].split()[0]
        self.port = int(self.url.rsplit(":", 1)[1])
        return True

    def engine_pid(self) -> int:
        """The engine-core process: the server's child running multiprocessing's spawn."""
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                cmdline = (stat.parent / "cmdline").read_bytes()
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid and b"spawn_main" in cmdline:
                return int(stat.parent.name)
        raise RuntimeError("engine process not found")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@contextmanager
def running_server(model_dir: Path, log_path: Path, *extra_args: str) -> Iterator[ServerProcess]:
    """A ready server for the block's duration (one per test module or session: starting
    one costs seconds of CPU)."""
    proc = ServerProcess(model_dir, log_path, *extra_args)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def metric_value(url: str, name: str) -> float:
    """One sample of ``/metrics`` (the first series of the metric ``name``)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} not in /metrics:\n{text}")
