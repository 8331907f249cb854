"""Where torch.compile keeps its on-disk caches, and whether a compile hit them.

Inductor's FX-graph cache and the AOT-autograd cache are content-addressed: each entry's key
already holds the traced graph, the input shapes and dtypes, the torch / Triton versions and
the device. A warm start therefore needs nothing but a cache directory that survives between
processes. Inductor's default (``$TMPDIR/torchinductor_<user>``) does not survive a reboot or
a fresh container, so the engine points it at
``$XDG_CACHE_HOME/pagedserve/torch_compile/pagedserve-<version>_torch-<version>/`` (``~/.cache``
without ``XDG_CACHE_HOME``) unless the user chose one with ``TORCHINDUCTOR_CACHE_DIR``.

The directory is keyed by the pagedserve and torch versions only, not by the model config: the
entries are keyed by graph already, so one directory serves every model (and the identical
decoder-layer pieces of different models share entries); a version bump starts a clean
directory, so stale entries can be deleted with their folder.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

import pagedserve

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def default_compile_cache_dir(env: Mapping[str, str]) -> Path:
    """``$XDG_CACHE_HOME/pagedserve/torch_compile/pagedserve-<v>_torch-<v>`` (``~/.cache``)."""
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    version = f"pagedserve-{pagedserve.__version__}_torch-{torch.__version__}"
    return Path(base) / "pagedserve" / "torch_compile" / version.replace("+", "_")


def use_compile_cache_dir() -> Path:
    """Point Inductor at the pagedserve cache directory (kept if the user set one); returns it.

    Called once at start-up, before the first compile (Inductor reads the variable whenever
    it opens its cache)."""
    if not _user_chose_cache_dir(os.environ):
        os.environ[INDUCTOR_CACHE_ENV] = str(default_compile_cache_dir(os.environ))
    path = Path(os.environ[INDUCTOR_CACHE_ENV])
    path.mkdir(parents=True, exist_ok=True)
    return path


def _user_chose_cache_dir(env: Mapping[str, str]) -> bool:
    """Whether ``TORCHINDUCTOR_CACHE_DIR`` is the user's. Importing ``torch._dynamo`` (torch
    2.13) sets it to Inductor's own default when unset, which is not a choice."""
    chosen = env.get(INDUCTOR_CACHE_ENV)
    if not chosen:
        return False
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # an older torch: it does not set the variable on import either
        return True
    return os.path.abspath(chosen) != os.path.abspath(default_cache_dir())


_COUNTERS = (
    ("aot_autograd", "autograd_cache_hit"),
    ("aot_autograd", "autograd_cache_miss"),
    ("aot_autograd", "autograd_cache_bypass"),
    ("inductor", "fxgraph_cache_hit"),
    ("inductor", "fxgraph_cache_miss"),
    ("inductor", "fxgraph_cache_bypass"),
)


@dataclass(frozen=True)
class CacheCounts:
    """Cache lookups of one compile (deltas of torch's process-wide counters)."""

    aot_hits: int = 0
    aot_misses: int = 0
    aot_bypasses: int = 0
    fx_hits: int = 0
    fx_misses: int = 0
    fx_bypasses: int = 0

    def __sub__(self, other: CacheCounts) -> CacheCounts:
        return CacheCounts(*(a - b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)))

    def as_tuple(self) -> tuple[int, ...]:
        return (self.aot_hits, self.aot_misses, self.aot_bypasses, self.fx_hits,
                self.fx_misses, self.fx_bypasses)


def read_cache_counts() -> CacheCounts:
    from torch._dynamo.utils import counters

    return CacheCounts(*(int(counters[group][name]) for group, name in _COUNTERS))
