"""Integer helpers shared by the host code (Triton kernels keep their own ``tl.cdiv``)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up, for b > 0."""
    return -(-a // b)


def round_up(a: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= a."""
    return cdiv(a, multiple) * multiple


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, for n >= 1; 0 for 0 (an empty table stays empty)."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()
