"""Integer helpers shared by the host code (Triton kernels keep their own ``tl.cdiv``)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up, for b > 0."""
    return -(-a // b)


def round_up(a: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= a."""
    return cdiv(a, multiple) * multiple
