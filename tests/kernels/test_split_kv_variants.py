"""The split-KV kernels compile one variant for every split count.

Triton compiles a kernel once per specialization key: its constexpr values plus, for the other
arguments, what it specializes on (dtype, pointer alignment, ints equal to 1 or divisible by
16). The interpreter compiles nothing, so these tests record each launch's arguments and ask
Triton's own binder (the one ``JITFunction.run`` keys its cache with) for the key.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kernel_device import ON_GPU
from paged_kv_cases import SENTINEL, make_paged_batch, write_step_kv
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction, create_function_from_signature

import pagedserve.kernels.paged_attention_split as split_mod

KERNELS = ("_split_kv_kernel", "_reduce_splits_kernel")

# These read the interpreter's kernel objects; on the card test_paged_attention.py compiles them.
pytestmark = pytest.mark.skipif(ON_GPU, reason="written for the interpreter's kernel objects")


def _cache_key(kernel: Any, args: tuple, kwargs: dict) -> tuple:
    """What Triton's compile cache keys this launch by (specialization and launch options)."""
    jit_fn = JITFunction(kernel.fn, **kernel.kwargs)
    binder = create_function_from_signature(jit_fn.signature, jit_fn.params, BaseBackend)
    _, specialization, options = binder(*args, **kwargs)
    return tuple(specialization), tuple(sorted(options.items()))


def _launch_keys(monkeypatch: pytest.MonkeyPatch, num_splits: int) -> dict[str, tuple]:
    """Run the split-KV attention once; the cache key of each of its two launches."""
    keys: dict[str, tuple] = {}
    for name in KERNELS:
        kernel = getattr(split_mod, name)

        def run(*args, grid, warmup, _kernel=kernel, _name=name, **kwargs):
            keys[_name] = _cache_key(_kernel, args, kwargs)
            return type(_kernel).run(_kernel, *args, grid=grid, warmup=warmup, **kwargs)

        monkeypatch.setattr(kernel, "run", run)
    torch.manual_seed(0)  # the same batch (and buffer alignments) for every split count
    batch = make_paged_batch([1, 1], [40, 70], 4, 2, 64, 4, torch.float32)
    write_step_kv(batch)
    meta = batch.metadata
    split_mod.paged_attention_split_kv(
        batch.query, batch.kv_cache, meta.block_table, meta.query_start_loc, meta.seq_lens,
        meta.num_reqs, 0.125, torch.full_like(batch.query, SENTINEL), num_splits,
    )  # fmt: skip
    monkeypatch.undo()
    return keys


def test_every_split_count_shares_one_compiled_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 and 3 against 16 and 32: an int argument 16 or 32 would specialize (divisible by 16).
    keys = [_launch_keys(monkeypatch, n) for n in (2, 3, 16, split_mod.MAX_NUM_SPLITS)]
    assert set(keys[0]) == set(KERNELS)
    for name in KERNELS:
        assert len({k[name] for k in keys}) == 1, f"{name}: one variant per split count"


@pytest.mark.parametrize("name", KERNELS)
def test_split_count_is_a_runtime_argument(name: str) -> None:
    kernel = getattr(split_mod, name)
    params = {p.name: p for p in JITFunction(kernel.fn, **kernel.kwargs).params}
    assert not params["num_splits"].is_constexpr and params["num_splits"].do_not_specialize
    assert "NUM_SPLITS" not in params
