"""A CPU kernel library built for x86-64-v3 (AVX2 and FMA, no AVX512), so that machines with
AVX512 also run the code paths of CPUs without it."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from pagedserve.attention.backends import cpu_native


def built_for_avx2(source: Path, cache_home: Path) -> Path:
    """``source`` built with ``-march=x86-64-v3`` into a cache under ``cache_home``; skips the
    test off x86."""
    if platform.machine() != "x86_64":
        pytest.skip("an x86 -march name")
    flags = [f if f != "-march=native" else "-march=x86-64-v3" for f in cpu_native.COMPILE_FLAGS]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_native, "COMPILE_FLAGS", flags)
        patch.setenv("XDG_CACHE_HOME", str(cache_home))
        return cpu_native.built_library(source)
