"""Type checks for dataclass fields typed ``bool``, ``int``, ``float`` or ``str`` (or one of
them ``| None``), and for lists of token ids: the engine config, ``SamplingParams`` and the
prompts refuse a value of another type with a ``ValueError`` that names the field, instead of
failing later somewhere less clear."""

from __future__ import annotations

import functools
import numbers
import re
import types
import typing
from typing import Any

ByteSize = typing.NewType("ByteSize", int)
"""A count of bytes: an int, or (from the CLI or ``LLM(...)``) text such as ``4GiB``."""
_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}  # fmt: skip
"""Unit -> bytes: KiB/MiB/GiB/TiB and the bare K/M/G/T are powers of 1024 (as ``free -h``
and Docker's ``--memory``), KB/MB/GB/TB powers of 1000; case does not matter."""
_BYTE_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def byte_size(field: str, value: Any) -> int:
    """``value`` (an int, or text like ``4GiB``, ``512MB``, ``1.5G``, ``1073741824``) as a
    whole number of bytes; ValueError naming ``field`` otherwise."""
    if holds(value, int):
        return int(value)
    match = _BYTE_SIZE.fullmatch(value) if isinstance(value, str) else None
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _BYTE_UNITS:
        raise ValueError(
            f"{field}: expected a byte count such as 4GiB, 512MiB, 2GB or 1073741824, "
            f"got {value!r}"
        )
    return int(float(match.group(1)) * _BYTE_UNITS[unit])


def require(ok: bool, msg: str) -> None:
    """Raise ``ValueError(msg)`` unless ``ok``: the one-line field checks of the configs."""
    if not ok:
        raise ValueError(msg)


def without_none(tp: Any) -> Any:
    """``X | None`` -> X; anything else unchanged."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        return next(a for a in args if a is not type(None))
    return tp


@functools.cache
def _scalar_fields(cls: type) -> dict[str, tuple[type, bool]]:
    """Field name -> (bool, int, float or str, whether None is allowed too)."""
    out = {}
    for name, tp in typing.get_type_hints(cls).items():
        base = without_none(tp)
        base = getattr(base, "__supertype__", base)  # ByteSize -> int
        if base in (bool, int, float, str):
            out[name] = (base, base is not tp)
    return out


def holds(value: Any, tp: type) -> bool:
    """Whether ``value`` is a ``tp``: any integer for int, any real for float; a bool is
    neither, though Python counts it as an int."""
    if tp is bool or isinstance(value, bool):
        return tp is bool and isinstance(value, bool)
    if tp is int:
        return isinstance(value, numbers.Integral)
    if tp is float:
        return isinstance(value, numbers.Real)
    return isinstance(value, tp)


def check_field_types(obj: object) -> None:
    """Raise ValueError naming the first bool / int / float / str field of ``obj`` that holds
    a value of another type (None passes where the field allows it)."""
    cls: type = type(obj)
    for name, (tp, optional) in _scalar_fields(cls).items():
        value = getattr(obj, name)
        if not (holds(value, tp) or (optional and value is None)):
            raise ValueError(
                f"{name}: expected {tp.__name__}{' or None' if optional else ''}, got {value!r}"
            )


def shown(value: Any) -> str:
    """``repr(value)`` cut to 60 characters, for an error message about a user's value."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def token_id_list(field: str, ids: Any) -> list[int]:
    """``ids`` as a list of Python ints; ValueError naming ``field`` unless it is a list or
    tuple of integers (not bools)."""
    if isinstance(ids, (list, tuple)) and all(type(t) is int for t in ids):
        return list(ids)  # the common case, a C-speed check (bools are not ints here)
    if not isinstance(ids, (list, tuple)) or not all(holds(t, int) for t in ids):
        raise ValueError(f"{field}: expected a list of token ids (ints), got {shown(ids)}")
    return [int(t) for t in ids]
