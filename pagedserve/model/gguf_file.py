"""A GGUF file's metadata and tensor table, read with ``struct`` over a read-only memory map.

Why not ``gguf.GGUFReader``: it builds a numpy memmap view for every value it meets, and a
vocabulary plus its merge table are ~100k strings, so most of the read goes to
``np.memmap.__array_finalize__`` (docs/cpu.md#start-up-on-the-host). This reads the same header
with ``struct``, building no array per value. Arrays of strings (``tokenizer.ggml.tokens``,
``tokenizer.ggml.merges``) are walked but not decoded, only their length is kept; the tokenizer
reads them itself.

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, u32 version, u64 tensor count, u64
key/value count; the key/values; one entry per tensor (name, u32 n_dims, u64 dims innermost
first, u32 ggml type, u64 offset); padding to ``general.alignment``; the tensor data.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedserve.math_utils import round_up

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
_SCALAR_FORMATS = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"
}
"""GGUF value type -> struct format of the fixed-size types (8: string, 9: array)."""


@dataclass(frozen=True)
class StringArray:
    """A metadata array of strings, left undecoded: only its length is used here."""

    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]
    """Torch order (outermost dimension first); GGUF lists it innermost first."""
    qtype: GGMLQuantizationType
    data: np.ndarray
    """uint8 [num_bytes], a read-only view of the memory map (quantized blocks or raw floats)."""


class _Cursor:
    """Sequential little-endian reads from a buffer; raises ``struct.error`` past its end."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        end = self.pos + length
        if end > len(self.buffer):
            raise struct.error(f"a string of {length} bytes runs past the end of the file")
        text = self.buffer[self.pos : end].decode("utf-8", errors="replace")
        self.pos = end
        return text

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            self.pos += 8 + struct.unpack_from("<Q", self.buffer, self.pos)[0]

    def value(self, value_type: int) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.scalar("I"), self.scalar("Q")
            if item_type == _STRING:
                self.skip_strings(count)
                return StringArray(count)
            if item_type in _SCALAR_FORMATS:
                fmt = f"<{count}{_SCALAR_FORMATS[item_type]}"
                values = list(struct.unpack_from(fmt, self.buffer, self.pos))
                self.pos += struct.calcsize(fmt)
                return values
            return [self.value(item_type) for _ in range(count)]  # nested arrays
        raise ValueError(f"unknown GGUF value type {value_type}")


class GGUFFile:
    """The parsed header of one GGUF file; tensor data stays in the memory map until read."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < len(GGUF_MAGIC):
                    raise ValueError(f"{self.path}: not a GGUF file (too short)")
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            cursor = _Cursor(self._map)
            self.version, num_tensors, num_keys = self._read_preamble(cursor)
            self.metadata: dict[str, Any] = {}
            for _ in range(num_keys):
                key = cursor.string()
                self.metadata[key] = cursor.value(cursor.scalar("I"))
            entries = [self._read_tensor_entry(cursor) for _ in range(num_tensors)]
        except (OSError, struct.error) as e:
            raise ValueError(f"{self.path}: not a readable GGUF file: {e}") from e
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = round_up(cursor.pos, alignment)
        self.tensors = [self._tensor(data_start, *entry) for entry in entries]

    def _read_preamble(self, cursor: _Cursor) -> tuple[int, int, int]:
        if self._map[:4] != GGUF_MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (no GGUF magic bytes)")
        cursor.pos = 4
        version = cursor.scalar("I")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(
                f"{self.path}: GGUF version {version} is not supported (supported: 2, 3; "
                f"big-endian files are not supported either)"
            )
        return version, cursor.scalar("Q"), cursor.scalar("Q")

    @staticmethod
    def _read_tensor_entry(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = cursor.string()
        num_dims = cursor.scalar("I")
        dims = struct.unpack_from(f"<{num_dims}Q", cursor.buffer, cursor.pos)
        cursor.pos += 8 * num_dims
        raw_type, offset = cursor.scalar("I"), cursor.scalar("Q")
        return name, tuple(reversed(dims)), raw_type, offset

    def _tensor(
        self, data_start: int, name: str, shape: tuple[int, ...], raw_type: int, offset: int
    ) -> GGUFTensor:
        try:
            qtype = GGMLQuantizationType(raw_type)
            block_size, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError) as e:
            raise ValueError(f"{self.path}: tensor {name!r} has unknown GGML type {raw_type}") from e
        num_elements = int(np.prod(shape, dtype=np.int64))
        num_bytes = num_elements // block_size * type_size
        start = data_start + offset
        if start + num_bytes > len(self._map):
            raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file")
        data = np.frombuffer(self._map, dtype=np.uint8, count=num_bytes, offset=start)
        return GGUFTensor(name, shape, qtype, data)
