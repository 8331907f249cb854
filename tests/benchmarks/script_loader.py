"""Import a script of benchmarks/ as a module (the folder is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@contextmanager
def loaded_script(name: str) -> Iterator[ModuleType]:
    """``benchmarks/NAME.py`` (NAME may name a subfolder: ``peers/vllm/bench_vllm``) as a
    module, registered in ``sys.modules`` while in use (dataclasses look their module up there),
    with the folder on ``sys.path`` meanwhile (a script may import the others, as they do when
    run from it)."""
    path = BENCHMARKS / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))
        del sys.modules[spec.name]
