"""Rounding helpers of the host code."""

from __future__ import annotations

from pagedserve.math_utils import cdiv, next_power_of_2, round_up


def test_cdiv_rounds_up() -> None:
    assert [cdiv(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_round_up_to_a_multiple() -> None:
    assert [round_up(n, 64) for n in (0, 1, 64, 65)] == [0, 64, 64, 128]


def test_next_power_of_2() -> None:
    assert [next_power_of_2(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 1000)] == [
        0, 1, 2, 4, 4, 8, 8, 16, 1024]
