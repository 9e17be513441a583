"""A GGUF file's metadata and tensor table, parsed in one pass over a memory map.

gguf-py's ``GGUFReader`` builds a numpy view per element of every metadata array: for a 262k-token
vocabulary (tokens, scores, token types) that is millions of views and ~17 s on two cores, more
than dequantizing every tensor of the default model. This parser reads the same format (GGUF v2
and v3, little-endian) with ``struct`` and ``numpy.frombuffer`` in about a second, and hands the
tensors to gguf-py's dequantizers unchanged.

Every offset and length read from the file is checked against its size before use, so a truncated
or corrupt file raises ``ValueError`` instead of reading past the map.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 8

# metadata value types (GGUFValueType): fixed-size scalars; 8 is a string, 9 an array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9
# tensor types gguf-py exposes as values rather than as quantized blocks
_PLAIN_TYPES = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` is GGUF's ``ne`` (fastest dimension first); ``data`` is what gguf-py's
    dequantizers take (values for plain types, rows of block bytes for quantized ones)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    data_offset: int
    n_bytes: int
    data: np.ndarray


class GGUFFile:
    """The parsed file: ``fields`` maps each metadata key to a Python value (arrays of strings
    become lists of ``str``, numeric arrays lists of numbers), ``tensors`` lists the tensor table in
    file order. ``path`` names the file in error messages."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise ValueError(f"{size} bytes is too short for a GGUF header")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = memoryview(self._map)
        self._pos = 0
        if bytes(self._buf[:4]) != GGUF_MAGIC:
            raise ValueError("no GGUF magic")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", self._buf, 4)
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} (supported: {SUPPORTED_VERSIONS})")
        self._pos = 24
        self.fields: dict[str, Any] = {}
        for _ in range(self._bounded_count(n_fields, 12)):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"invalid general.alignment {alignment!r}")
        infos = [self._tensor_info() for _ in range(self._bounded_count(n_tensors, 24))]
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(name, ne, ggml_type, data_start + offset, size)
                        for name, ne, ggml_type, offset in infos]

    def field(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)

    # ---- parsing ---------------------------------------------------------------------------

    def _need(self, n: int) -> None:
        if n < 0 or self._pos + n > len(self._buf):
            raise ValueError(f"truncated: {n} bytes wanted at offset {self._pos}, file has {len(self._buf)}")

    def _unpack(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self._need(n)
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += n
        return value

    def _bounded_count(self, count: int, min_item_bytes: int) -> int:
        """A count read from the file, refused when its items could not fit in what is left."""
        if count * min_item_bytes > len(self._buf) - self._pos:
            raise ValueError(f"count {count} at offset {self._pos} does not fit in the file")
        return count

    def _string(self) -> str:
        n = self._unpack("<Q")
        self._need(n)
        raw = bytes(self._buf[self._pos:self._pos + n])
        self._pos += n
        return raw.decode("utf-8", errors="replace")

    def _value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self._unpack(_SCALARS[value_type])
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._unpack("<I"), self._unpack("<Q")
            if item_type in _NUMPY:
                dtype = np.dtype(_NUMPY[item_type])
                self._need(count * dtype.itemsize)
                items = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos)
                self._pos += count * dtype.itemsize
                return items.tolist()
            if item_type == _STRING:
                return self._strings(self._bounded_count(count, 8))
            return [self._value(item_type) for _ in range(self._bounded_count(count, 12))]
        raise ValueError(f"unknown metadata value type {value_type} at offset {self._pos}")

    def _strings(self, count: int) -> list[str]:
        buf, pos, end = self._buf, self._pos, len(self._buf)
        out = []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise ValueError(f"truncated string array at offset {pos}")
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > end:
                raise ValueError(f"truncated string array at offset {pos}")
            out.append(str(buf[pos:pos + n], "utf-8", "replace"))
            pos += n
        self._pos = pos
        return out

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        n_dims = self._unpack("<I")
        if not 0 < n_dims <= MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
        ne = tuple(self._unpack("<Q") for _ in range(n_dims))
        return name, ne, self._unpack("<I"), self._unpack("<Q")

    def _tensor(self, name: str, ne: tuple[int, ...], ggml_type: int, offset: int, size: int) -> GGUFTensor:
        try:
            qtype = GGMLQuantizationType(ggml_type)
        except ValueError:
            raise ValueError(f"tensor {name!r} has unknown type {ggml_type}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_elements = int(np.prod(ne, dtype=np.uint64))
        if n_elements % block:
            raise ValueError(f"tensor {name!r}: {n_elements} elements are not whole blocks of {block}")
        n_bytes = n_elements // block * type_size
        if offset + n_bytes > size:
            raise ValueError(f"truncated: tensor {name!r} ends at byte {offset + n_bytes}, file has {size} bytes")
        torch_order = tuple(reversed(ne))
        if qtype in _PLAIN_TYPES:
            data = np.frombuffer(self._buf, dtype=_PLAIN_TYPES[qtype], count=n_elements, offset=offset)
            data = data.reshape(torch_order)
        else:
            data = np.frombuffer(self._buf, dtype=np.uint8, count=n_bytes, offset=offset)
            data = data.reshape(quant_shape_to_byte_shape(torch_order, qtype))
        return GGUFTensor(name, ne, qtype, offset, n_bytes, data)
