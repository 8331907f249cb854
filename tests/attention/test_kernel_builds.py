"""``build_all``: every C source of the package built once, the builds at the same time, a
failed build named by its source; the libraries then found, not built again; a CPU engine's
start-up builds the missing ones the same way. The compiler is
replaced by a stand-in that writes an empty file (the real builds are tested by the kernels'
own tests)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from pagedserve.attention.backends import cpu_native
from pagedserve.attention.backends.cpu_native import __main__ as build_command
from pagedserve.attention.backends.cpu_native import prefill
from pagedserve.layers import cpu_gemv, cpu_rows
from pagedserve.model import cpu_decode
from pagedserve.platform import platform_for

LOADED_SOURCES = {cpu_native.SOURCE, prefill.SOURCE, cpu_gemv.SOURCE, cpu_rows.SOURCE,
                  cpu_decode.SOURCE}


class StandInCompiler:
    """``cpu_native.build``'s stand-in: records each source, holds each build 0.2 s (so
    builds run at once if they can), fails for the sources in ``failing``."""

    def __init__(self, failing: tuple[Path, ...] = ()) -> None:
        self.failing = failing
        self.built: list[Path] = []
        self.running = self.peak = 0
        self.lock = threading.Lock()

    def __call__(self, cc: str, target: Path, source: Path) -> None:
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        time.sleep(0.2)
        with self.lock:
            self.running -= 1
            self.built.append(source)
        if source in self.failing:
            raise RuntimeError(f"{cc} failed: stand-in error")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(b"")


@pytest.fixture
def compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def install(failing: tuple[Path, ...] = ()) -> StandInCompiler:
        stand_in = StandInCompiler(failing)
        monkeypatch.setattr(cpu_native, "build", stand_in)
        return stand_in
    return install


def test_every_source_is_built_once_and_at_once(compiler, tmp_path: Path) -> None:
    stand_in = compiler()
    results = cpu_native.build_all()
    assert set(results) == LOADED_SOURCES  # the package's C sources: the loaders' sources
    assert all(error is None for error in results.values())
    assert sorted(stand_in.built) == sorted(LOADED_SOURCES)
    assert stand_in.peak > 1
    assert len(list((tmp_path / "pagedserve" / "cpu_kernels").glob("*.so"))) == len(results)
    stand_in.built.clear()
    assert all(error is None for error in cpu_native.build_all().values())
    assert stand_in.built == []  # found, not built again


def test_a_failed_build_is_named_and_the_others_are_built(
    compiler, capsys: pytest.CaptureFixture[str]
) -> None:
    stand_in = compiler(failing=(prefill.SOURCE,))
    assert build_command.main() == 1
    assert sorted(stand_in.built) == sorted(LOADED_SOURCES)
    err = capsys.readouterr().err
    assert "C kernel paged_prefill.c not built: " in err and "stand-in error" in err
    assert "1 not built" in err
    assert cpu_native.build_all()[prefill.SOURCE] is not None  # tried again, fails again


def test_a_cpu_engine_start_builds_the_missing_kernels_at_once(compiler) -> None:
    stand_in = compiler()
    threads = torch.get_num_threads()
    try:
        platform_for("cpu").configure_process()  # what EngineCore and each CPU rank call
    finally:
        torch.set_num_threads(threads)
    assert sorted(stand_in.built) == sorted(LOADED_SOURCES) and stand_in.peak > 1
