"""Byte sizes with units (``--kv-cache-memory 4GiB``)."""

from __future__ import annotations

import pytest

from pagedserve.config import CacheConfig
from pagedserve.entrypoints.cli import main
from pagedserve.field_types import byte_size


@pytest.mark.parametrize(("text", "expected"), [
    (1024, 1024), ("1024", 1024), ("4GiB", 4 << 30), ("4gib", 4 << 30), ("4G", 4 << 30),
    ("2GB", 2 * 10**9), ("512MiB", 512 << 20), ("512 MB", 512 * 10**6), ("1.5G", 3 << 29),
    ("64k", 64 << 10), ("1TiB", 1 << 40), ("7B", 7),
])
def test_byte_size_units(text: object, expected: int) -> None:
    assert byte_size("f", text) == expected


@pytest.mark.parametrize("bad", ["4 bananas", "", "GiB", "-3G", "4GiBs", 4.5, True])
def test_byte_size_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^kv_cache_memory: expected a byte count"):
        CacheConfig(kv_cache_memory=bad)


def test_config_and_cli_take_units(capsys: pytest.CaptureFixture[str]) -> None:
    assert CacheConfig(kv_cache_memory="4GiB").kv_cache_memory == 4 << 30
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "x", "--kv-cache-memory", "4 bananas"])
    assert exit_info.value.code == 2
    assert "--kv-cache-memory: expected a byte count" in capsys.readouterr().err
