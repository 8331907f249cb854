"""The package builds as a wheel that carries everything it needs at run time (its web page,
the CPU kernels' C sources and headers) and runs ``pagedserve generate`` from an install of that wheel
alone, with no source tree on the path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_and_generates(tmp_path: Path) -> None:
    uv = shutil.which("uv")
    assert uv is not None, "uv (which scripts/install.sh installs) is needed to build the wheel"
    subprocess.run([uv, "build", "--wheel", "--quiet", "--out-dir", str(tmp_path / "dist"),
                    str(REPO_ROOT)], check=True, timeout=300)
    [wheel] = (tmp_path / "dist").glob("pagedserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "pagedserve/entrypoints/openai/static/index.html" in names
    package = REPO_ROOT / "pagedserve"
    c_sources = {f"pagedserve/{p.relative_to(package)}"
                 for p in [*package.rglob("*.c"), *package.rglob("*.h")]}
    assert "pagedserve/model/cpu_decode.c" in c_sources
    assert c_sources <= set(names), c_sources - set(names)  # the CPU kernels' sources, headers
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
    site = tmp_path / "site"
    subprocess.run([uv, "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                    str(wheel)], check=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = "import pagedserve, sys; print(pagedserve.__file__)"
    where = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(site)), where  # the wheel's copy, not the source tree's
    run = subprocess.run(
        [sys.executable, "-m", "pagedserve.entrypoints.cli", "generate", "The capital of France is",
         "--max-tokens", "4", "--temperature", "0"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip()
