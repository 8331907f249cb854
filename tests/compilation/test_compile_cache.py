"""The compile cache directory, the cache counters and the start-up phase records."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import pagedserve
from pagedserve.compilation import compile_cache
from pagedserve.compilation.compile_cache import CacheCounts, default_compile_cache_dir
from pagedserve.compilation.phase_log import log_phase


def test_default_dir_is_under_xdg_cache_home_and_keyed_by_versions(tmp_path: Path) -> None:
    path = default_compile_cache_dir({"XDG_CACHE_HOME": str(tmp_path)})
    assert path.parent == tmp_path / "pagedserve" / "torch_compile"
    assert pagedserve.__version__ in path.name
    assert torch.__version__.replace("+", "_") in path.name
    home = default_compile_cache_dir({})
    assert home.parents[2] == Path.home() / ".cache"


def test_inductor_is_pointed_at_the_dir_unless_the_user_chose_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(compile_cache.INDUCTOR_CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    chosen = compile_cache.use_compile_cache_dir()
    assert chosen == default_compile_cache_dir({"XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert chosen.is_dir()
    mine = tmp_path / "mine"
    monkeypatch.setenv(compile_cache.INDUCTOR_CACHE_ENV, str(mine))
    assert compile_cache.use_compile_cache_dir() == mine and mine.is_dir()


def test_cache_counts_subtract_field_by_field() -> None:
    after, before = CacheCounts(5, 1, 0, 4, 2, 1), CacheCounts(2, 1, 0, 1, 0, 0)
    assert after - before == CacheCounts(3, 0, 0, 3, 2, 1)
    assert compile_cache.read_cache_counts() - compile_cache.read_cache_counts() == CacheCounts()


def test_phase_records_carry_their_figures(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("pagedserve.test_phase")
    with caplog.at_level(logging.INFO, logger="pagedserve.test_phase"):
        log_phase(logger, "capture PIECEWISE", 1.5, "50 sizes", graphs=1650)
    (record,) = caplog.records
    assert record.getMessage() == "start-up: capture PIECEWISE took 1.50 s (50 sizes)"
    assert (record.startup_phase, record.startup_seconds) == ("capture PIECEWISE", 1.5)
    assert record.startup_figures == {"graphs": 1650}
