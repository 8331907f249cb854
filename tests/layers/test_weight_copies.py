"""The per-weight cache of packed copies: made once, made again after an in-place write,
forgotten with the weight, bounded by the budget."""

from __future__ import annotations

import torch

from pagedserve.layers.cpu_pack_budget import PackBudget
from pagedserve.layers.weight_copies import WeightCopies


def copies(budget_bytes: int = 2**20) -> WeightCopies:
    return WeightCopies(lambda w: w.t().contiguous(), "test copy",
                        PackBudget(lambda: budget_bytes, share=1.0))


def test_a_copy_is_made_once_and_again_after_an_in_place_write() -> None:
    cache, w = copies(), torch.randn(8, 32)
    first = cache.get(w)
    assert first is not None and torch.equal(first, w.t())
    assert cache.get(w) is first
    w.mul_(2)
    second = cache.get(w)
    assert second is not first and torch.equal(second, w.t())
    assert len(cache) == 1


def test_has_tells_whether_get_would_make_a_copy() -> None:
    cache, w = copies(), torch.randn(8, 32)
    assert not cache.has(w)
    cache.get(w)
    assert cache.has(w)
    w.add_(1)  # an in-place write: the copy is stale
    assert not cache.has(w)


def test_a_dead_weight_takes_its_copy_and_its_bytes_along() -> None:
    cache = copies(budget_bytes=8 * 32 * 4)  # room for one [8, 32] fp32 copy
    w1, w2 = torch.randn(8, 32), torch.randn(8, 32)
    assert cache.get(w1) is not None
    assert cache.get(w2) is None  # over the budget: the caller keeps the plain weight
    del w1
    assert len(cache) == 0
    assert cache.get(w2) is not None
