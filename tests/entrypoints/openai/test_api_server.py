"""The serve command's signal handling: a first Ctrl-C drains, a second one exits at once."""

from __future__ import annotations

import signal

import uvicorn

from pagedserve.entrypoints.openai.api_server import _Server


class _DrainingEngine:
    def __init__(self) -> None:
        self.cut = 0

    num_in_flight = 3

    def cut_drain(self) -> None:
        self.cut += 1


def test_second_ctrl_c_forces_the_exit_and_cuts_the_drain(capsys) -> None:
    engine = _DrainingEngine()
    server = _Server(uvicorn.Config(app=None), engine, drain_timeout=10.0)  # type: ignore[arg-type]
    server.handle_exit(signal.SIGINT, None)
    assert server.should_exit and not server.force_exit and engine.cut == 0
    assert "3 request(s) in flight get up to 10 s" in capsys.readouterr().err
    server.handle_exit(signal.SIGINT, None)
    assert server.force_exit and engine.cut == 1
    assert "exiting at once" in capsys.readouterr().err
