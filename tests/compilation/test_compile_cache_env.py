"""Inductor's own default in TORCHINDUCTOR_CACHE_DIR (torch sets it when Dynamo is imported)
is not the user's choice: the engine still points Inductor at its directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from pagedserve.compilation import compile_cache


def test_torchs_default_is_replaced_a_users_dir_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(compile_cache.INDUCTOR_CACHE_ENV, default_cache_dir())
    ours = compile_cache.default_compile_cache_dir({"XDG_CACHE_HOME": str(tmp_path)})
    assert compile_cache.use_compile_cache_dir() == ours
    monkeypatch.setenv(compile_cache.INDUCTOR_CACHE_ENV, str(tmp_path / "mine"))
    assert compile_cache.use_compile_cache_dir() == tmp_path / "mine"
