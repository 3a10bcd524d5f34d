"""A GGUF file's metadata read in one pass, for ``runner.gguf_tensors``' reader.

llama.cpp's ``gguf.GGUFReader`` keeps every metadata value as numpy views, two per string
of an array, so a 49k-token vocabulary with its merges (about 100k strings) costs a few
seconds of every load. This reads the same key-value section straight into plain Python
(``contents()`` gives what the reader's fields give) and hands the reader the offset where
its tensor infos start; the reader still parses those and maps the tensors. Strings are
strict UTF-8, as the reader decodes them; a value type outside the format is a ``ValueError``
(the caller names the file).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

STRING, ARRAY = 8, 9
# GGUF value types of fixed size: their numpy dtype (little-endian: a file of the other byte
# order is refused before its metadata is read).
SCALARS = {
    0: np.dtype("<u1"),
    1: np.dtype("<i1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i2"),
    4: np.dtype("<u4"),
    5: np.dtype("<i4"),
    6: np.dtype("<f4"),
    7: np.dtype("?"),
    10: np.dtype("<u8"),
    11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}


@dataclass
class Field:
    """One metadata item: its name, GGUF value types (an array's then its items'), and its
    value as plain Python."""

    name: str
    types: list[int]
    value: object

    def contents(self) -> object:
        return self.value

    @property
    def parts(self) -> list[np.ndarray]:
        """The value as the reader's last part holds a scalar (it reads
        ``general.alignment`` so)."""
        return [np.asarray([self.value])]


def read_fields(data: np.ndarray, offset: int, count: int) -> tuple[dict[str, Field], int]:
    """``count`` key-value items from ``offset`` of the file's bytes ``data``: the fields by
    name (a repeated key is a ``KeyError``, as the reader has it) and the offset after them."""
    buf = memoryview(data)
    fields: dict[str, Field] = {}
    for _ in range(count):
        name, offset = _string(buf, offset)
        (kind,), offset = struct.unpack_from("<I", buf, offset), offset + 4
        value, types, offset = _value(data, buf, offset, kind)
        if name in fields:
            raise KeyError(f"duplicate metadata key {name!r}")
        fields[name] = Field(name, types, value)
    return fields, offset


def _string(buf: memoryview, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, offset)
    start = offset + 8
    if start + length > len(buf):
        raise ValueError(f"a string of {length} bytes runs past the end of the file")
    return str(buf[start : start + length], "utf-8"), start + length


def _value(data: np.ndarray, buf: memoryview, offset: int, kind: int) -> tuple:
    """``(value, types, offset after it)`` of a value of GGUF type ``kind`` at ``offset``."""
    if kind == STRING:
        text, offset = _string(buf, offset)
        return text, [STRING], offset
    dtype = SCALARS.get(kind)
    if dtype is not None:
        value = np.frombuffer(data, dtype, 1, offset)[0].item()
        return value, [kind], offset + dtype.itemsize
    if kind != ARRAY:
        raise ValueError(f"unknown metadata value type {kind}")
    item, length = struct.unpack_from("<IQ", buf, offset)
    offset += 12
    dtype = SCALARS.get(item)
    if dtype is not None:
        if offset + length * dtype.itemsize > len(buf):
            raise ValueError(f"an array of {length} values runs past the end of the file")
        values = np.frombuffer(data, dtype, length, offset).tolist()
        return values, [ARRAY, item] if length else [ARRAY], offset + length * dtype.itemsize
    values, types = [], [ARRAY]  # an empty array names no item type (as the reader has it)
    for index in range(length):
        value, inner, offset = _value(data, buf, offset, item)
        values.append(value)
        if index == 0:
            types += inner
    return values, types, offset
