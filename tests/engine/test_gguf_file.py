"""The fast GGUF parser reads what gguf-py's own reader reads, and refuses hostile headers cheaply."""
from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from common.engine.loading.gguf_file import GGUFFile
from tests.support.gguf_checkpoints import Q, tiny_model, write_gguf


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.Q5_0], ids=["f32", "q8_0", "q5_0"])
def test_fields_and_tensors_equal_gguf_py(tmp_path, qtype):
    path = tmp_path / "m.gguf"
    write_gguf(tiny_model("gemma3"), "gemma3", path, qtype)
    ours, reference = GGUFFile(path), gguf.GGUFReader(path, "r")

    want = {name: field.contents() for name, field in reference.fields.items() if not name.startswith("GGUF.")}
    assert ours.fields == want
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors):
        assert mine.shape == tuple(theirs.shape.tolist()), mine.name
        assert mine.tensor_type == theirs.tensor_type and mine.data_offset == theirs.data_offset, mine.name
        assert mine.n_bytes == theirs.n_bytes and mine.data.shape == theirs.data.shape, mine.name
        np.testing.assert_array_equal(gguf.quants.dequantize(mine.data, mine.tensor_type),
                                      gguf.quants.dequantize(theirs.data, theirs.tensor_type))


def _header(n_tensors: int, fields: bytes, n_fields: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_fields) + fields


def _key(name: str) -> bytes:
    raw = name.encode()
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize("blob, message", [
    (b"GGUF" + struct.pack("<IQQ", 9, 0, 0), "version 9"),
    (_header(0, b"", 1 << 60), "does not fit"),  # a field count no file could hold
    (_header(0, _key("a") + struct.pack("<IIQ", 9, 8, 1 << 60), 1), "does not fit"),  # a huge string array
    (_header(0, _key("a") + struct.pack("<IIQ", 9, 6, 1 << 40), 1), "truncated"),  # a huge float array
    (_header(0, _key("a") + struct.pack("<IQ", 8, 1 << 50), 1), "truncated"),  # a string past the end
    (_header(0, _key("a") + struct.pack("<I", 77), 1), "unknown metadata value type 77"),
    (_header(1, _key("t") + struct.pack("<I", 99), 0), "dimensions"),
    (_header(1, _key("t") + struct.pack("<IQIQ", 1, 64, 0, 0), 0), "truncated: tensor 't'"),
], ids=["version", "field-count", "string-array", "float-array", "string", "value-type", "dims", "tensor-data"])
def test_hostile_headers_raise_value_error(tmp_path, blob, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(blob + b"\0" * 64)
    with pytest.raises(ValueError, match=message):
        GGUFFile(path)
