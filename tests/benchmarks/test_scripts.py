"""Every script in benchmarks/ imports on the CPU: the engine names it uses still exist.

The scripts themselves need a GPU (or minutes of CPU time); importing one runs its module
level (imports, constants, argument tables) without its ``main``.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py"))


def test_the_kept_scripts_are_the_listed_ones() -> None:
    assert SCRIPTS == ["attention_ptx", "attention_sweep", "cpu_attention_bench", "cpu_decode_step_bench",
                       "cpu_prefill_attention_bench",
                       "cpu_profile", "cpu_rope_rows_bench", "cpu_vs_transformers", "cpu_vs_vllm",
                       "fp8_gemm_sweep", "fp8_quant_sweep", "fp8_suite", "gemv_sweep", "gpu_profile", "lora_bench",
                       "mixed_attention", "plot_decode",
                       "sampler_bench", "sched_sim", "spec_decode_bench", "spec_decode_jobs", "startup_check",
                       "structured",
                       "suite", "tp_check",
                       "vs_vllm"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_imports(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"bench_script_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    assert callable(module.main)


def private_names(source: str) -> list[str]:
    """Names starting with one underscore that ``source`` imports from pagedserve or reads as
    an attribute (``llm._step``, ``runner._x``); dunders and the script's own names are fine."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pagedserve"):
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names
                      if a.name.startswith("pagedserve") and "._" in a.name]
        elif isinstance(node, ast.Attribute):
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_private_names_are_found() -> None:
    assert private_names("from pagedserve.x import _y, z\nllm._step()\nm.__doc__") == [
        "pagedserve.x._y", "line 2: ._step"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_no_script_uses_a_private_name(name: str) -> None:
    """Benchmarks run on the public API: no private name of the engine."""
    assert private_names((BENCHMARKS / f"{name}.py").read_text()) == []
