"""TP=2 with torch.compile on the CPU (mp backend, gloo): on a cold start every rank traces its
forward and saves it (``compilation/aot_forward.py``); a warm start (a new engine, new worker
processes, the same cache folder) loads both instead of tracing. Both give the TP=1 tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve import LLM
from pagedserve.compilation.aot_forward import AOT_ENV, ARTIFACT_DIR
from pagedserve.compilation.compile_cache import INDUCTOR_CACHE_ENV
from tests.distributed.tiny_tp import ENGINE_ARGS, assert_same_outputs, generate


def _saved_forwards(cache: Path) -> dict[Path, int]:
    """Saved forward file -> its modification time (ns)."""
    files = cache.glob(f"{ARTIFACT_DIR}/*.bin")
    return {path: path.stat().st_mtime_ns for path in files}


def _compiled_tp2(model: Path) -> LLM:
    return LLM(str(model), tensor_parallel_size=2, mode="compile", **ENGINE_ARGS)


def test_each_rank_saves_its_forward_and_a_warm_start_loads_them(
    checkpoint, tp1_outputs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # noqa: ANN001
) -> None:
    # The workers inherit it. XDG_CACHE_HOME stays: a fresh one would build the C kernels again.
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(AOT_ENV, "1")
    expected = tp1_outputs("llama")
    for start in ("cold", "warm"):
        llm = _compiled_tp2(checkpoint("llama"))
        try:
            assert_same_outputs(generate(llm), expected)
        finally:
            llm.engine_core.shutdown()
        if start == "cold":
            saved = _saved_forwards(tmp_path)
            assert len(saved) == 2, f"one saved forward per rank, got {sorted(saved)}"
    # Loaded, not traced again: a forward that failed to load is removed and saved anew.
    assert _saved_forwards(tmp_path) == saved
