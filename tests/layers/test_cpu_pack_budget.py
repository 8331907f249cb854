"""The packed-copy budget: a share of the memory available at the first copy."""

from __future__ import annotations

import logging

import pytest

from pagedserve.layers.cpu_pack_budget import PackBudget


def test_takes_until_the_share_is_spent_and_gets_bytes_back() -> None:
    calls = []

    def available() -> int:
        calls.append(1)
        return 1000

    budget = PackBudget(available, share=0.5)
    assert budget.take(300, "a") and budget.take(200, "b")
    assert not budget.take(1, "c")
    budget.give_back(200)
    assert budget.take(150, "d") and not budget.take(51, "e")
    assert len(calls) == 1  # read once, at the first copy


def test_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    budget = PackBudget(lambda: 100, share=1.0)
    with caplog.at_level(logging.WARNING):
        assert not budget.take(101, "the LM head")
        assert not budget.take(102, "another")
    assert len(caplog.records) == 1 and "the LM head" in caplog.text
