"""Saved forwards: the first start saves Dynamo's output, a later start in a fresh process
loads it instead of tracing, and a bad artifact falls back to tracing with one warning.

CPU runs with eager pieces (see test_compiled_forward); the saved part (Dynamo's bytecode and
graph) does not depend on the piece compiler."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from pagedserve.worker.model_runner import ModelRunner
from tests.compilation.test_compiled_forward import _generate

ROOT = Path(__file__).resolve().parents[2]
Factory = Callable[[str], ModelRunner]


def _start(model_dir: Path, out: Path) -> dict:
    """One engine start in a fresh process (aot_child), with this test's environment."""
    subprocess.run([sys.executable, "-m", "tests.compilation.aot_child", str(model_dir), str(out)],
                   cwd=ROOT, env=dict(os.environ), check=True, timeout=120)
    return torch.load(out)


def test_a_fresh_process_loads_the_saved_forward_instead_of_tracing(
    deep_llama_dir: Path, aot_cache: Path, tmp_path: Path
) -> None:
    cold = _start(deep_llama_dir, tmp_path / "cold.pt")
    (artifact,) = aot_cache.glob("*.bin")  # the first start saved one
    assert cold["aot_artifact"] is None and cold["frames_traced"] > 0
    warm = _start(deep_llama_dir, tmp_path / "warm.pt")
    assert warm["aot_artifact"] == str(artifact)
    assert warm["frames_traced"] == 0  # Dynamo did not trace
    assert warm["num_compiles"] == 1  # the backend still built its pieces
    assert warm["tokens"] == cold["tokens"]
    for w, c, n in zip(warm["hidden"], cold["hidden"], (12, 2, 1), strict=True):
        torch.testing.assert_close(w[:n], c[:n], rtol=0, atol=0)  # rows past n: padding


def test_a_corrupt_artifact_is_replaced_and_tracing_takes_over(
    deep_runner: Factory, aot_cache: Path, caplog
) -> None:
    torch._dynamo.reset()
    expected = _generate(deep_runner("none"))
    assert _generate(deep_runner("compile")) == expected
    (artifact,) = aot_cache.glob("*.bin")
    good = artifact.read_bytes()
    artifact.write_bytes(good[: len(good) // 2])  # a torn write
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="pagedserve.compilation"):
        runner = deep_runner("compile")
        assert _generate(runner) == expected
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "could not load" in warnings[0].getMessage()
    assert runner.compiled_forward.aot_artifact is None  # traced, then saved afresh
    assert artifact.is_file() and artifact.read_bytes() != good[: len(good) // 2]


def test_a_torch_without_aot_compile_falls_back_to_dynamo(
    deep_runner: Factory, aot_cache: Path, caplog, monkeypatch
) -> None:
    """torch.compile without ``enable_aot_compile`` returns no ``aot_compile``, as an older
    torch does: one warning, Dynamo's JIT path, nothing saved."""
    import contextlib

    from pagedserve.compilation import compiled_model

    monkeypatch.setattr(compiled_model, "_aot_compile_enabled", contextlib.nullcontext)
    torch._dynamo.reset()
    expected = _generate(deep_runner("none"))
    with (torch._dynamo.config.patch(enable_aot_compile=False),
          caplog.at_level(logging.WARNING, logger="pagedserve.compilation")):
        runner = deep_runner("compile")
        assert _generate(runner) == expected
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "has no aot_compile" in warning.getMessage()
    assert runner.compiled_forward.backend.num_compiles == 1
    assert not list(aot_cache.glob("*.bin"))
