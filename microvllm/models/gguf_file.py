"""A GGUF file's index, read without parsing its tokenizer: each load reads only this.

``gguf.GGUFReader`` turns every metadata value into numpy objects, the tokenizer's
~100,000 strings included: seconds per file. Loading the weights needs only the header,
a few scalar keys and the tensor index; everything else is stepped over::

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x   key (u64 length + bytes) | value type u32 | value
                 (a string: u64 length + bytes; an array: item type u32, count u64, items)
    tensor_count x  name | n_dims u32 | ne[0..n_dims) u64 | ggml type u32 | offset u64
    padding to general.alignment (32), then the tensors' data at their offsets

``ne[0]`` is a row's length (the input features), ``ne[1]`` the number of rows. The
tensors come back as numpy views of a memory map of the file (nothing is read until used).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# GGML type id -> (name, weights per block, bytes per block): the common ones, so that a load
# needs no ``gguf`` import (tests/quantization check the table against gguf.GGML_QUANT_SIZES);
# any other id is looked up in the ``gguf`` package.
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
              6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
              10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
              14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 30: ("BF16", 1, 2)}


def ggml_type(kind: int) -> tuple[str, int, int]:
    """``(name, weights per block, bytes per block)`` of GGML type id ``kind``."""
    if kind in GGML_TYPES:
        return GGML_TYPES[kind]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType(kind)
    return (qtype.name, *GGML_QUANT_SIZES[qtype])


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str          # GGML's name: "Q4_1", "Q8_0", "F16", "F32", ...
    shape: tuple[int, ...]  # ne: shape[0] = a row's length
    data: np.ndarray        # uint8 [rows, row_bytes] for block formats; float16 / float32 [rows, ne0]


class GGUFIndex:
    """The scalar metadata (``fields``) and tensors of a GGUF file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buffer = self._map
        if buffer[:4] != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic)")
        self.offset = 8
        tensor_count, kv_count = self._unpack("<QQ")
        self.fields: dict[str, object] = {}
        for _ in range(kv_count):
            key = self._string()
            (kind,) = self._unpack("<I")
            value = self._value(kind)
            if value is not None:
                self.fields[key] = value
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            shape = self._unpack(f"<{n_dims}Q")
            kind, offset = self._unpack("<IQ")
            infos.append((name, ggml_type(kind), tuple(shape), offset))
        alignment = int(self.fields.get("general.alignment", 32))   # type: ignore[call-overload]
        start = -(-self.offset // alignment) * alignment
        everything = np.frombuffer(buffer, dtype=np.uint8)
        self.tensors = []
        for name, (type_name, block, size), shape, offset in infos:
            rows = int(np.prod(shape[1:])) if len(shape) > 1 else 1
            row_bytes = shape[0] // block * size
            raw = everything[start + offset:start + offset + rows * row_bytes].reshape(rows, row_bytes)
            if type_name in ("F32", "F16"):
                raw = raw.view(np.float32 if type_name == "F32" else np.float16)
            if len(shape) == 1:
                raw = raw.reshape(-1)
            self.tensors.append(GGUFTensor(name, type_name, shape, raw))

    def close(self) -> None:
        """Unmap the file (its pages stop counting as this process's memory); the tensors'
        data must not be used afterwards."""
        self.tensors = []
        try:
            self._map.close()
        except BufferError:   # a view is still alive somewhere: the mapping goes with it
            pass
    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._map, self.offset)
        self.offset += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        text = bytes(self._map[self.offset:self.offset + length]).decode("utf-8", errors="replace")
        self.offset += length
        return text

    def _value(self, kind: int):
        """The value of a scalar or string; arrays are stepped over (None)."""
        if kind == STRING:
            return self._string()
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])[0]
        if kind != ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {kind}")
        item, count = self._unpack("<IQ")
        if item in _SCALARS:
            self.offset += struct.calcsize(_SCALARS[item]) * count
        elif item == STRING:   # the tokenizer's tokens and merges: lengths only, nothing decoded
            offset, buffer = self.offset, self._map
            for _ in range(count):
                offset += 8 + struct.unpack_from("<Q", buffer, offset)[0]
            self.offset = offset
        else:
            for _ in range(count):
                self._value(item)
        return None
