"""JSON read within bounds: arrays refused past a length before their elements are decoded, and the
field of a body that is nested too deeply named.

``Annotated[list[T], msgspec.Meta(max_length=N)]`` is checked by msgspec only once every element
has been decoded: a 4 MiB body holding a million tiny elements builds a million Python objects
(about 0.1 s of the event loop) before the 400.  ``bounded_list(T, N)`` is a type msgspec stops
decoding at element N + 1 -- an ``array_like`` struct of N optional fields, refused with
"Expected `array` of at most length N" -- so refusing a longer array costs what reading N elements
costs.  ``items(value)`` gives its elements as a list.  That error carries no path: decode each such
field on its own (from ``msgspec.Raw``) and name the field yourself.
"""
from __future__ import annotations

import functools
import re
from typing import Any, Union

import msgspec

_raw = msgspec.json.Decoder(msgspec.Raw)
_key = msgspec.json.Decoder(str)
_TRAILING_RE = re.compile(r"trailing characters \(byte (\d+)\)$")
_NOT_WHITESPACE_RE = re.compile(rb"[^ \t\r\n]")
MAX_TOP_LEVEL_FIELDS = 64  # how many fields of a too-deep body are looked through for the culprit


@functools.cache
def bounded_list(item: Any, max_items: int, min_items: int = 0) -> type[msgspec.Struct]:
    """A type that decodes a JSON array of ``min_items`` to ``max_items`` elements of type ``item``
    (read it with ``items``); a longer array is refused at element ``max_items + 1``."""
    fields = [(f"e{i}", item) if i < min_items else (f"e{i}", Union[item, msgspec.UnsetType], msgspec.UNSET)
              for i in range(max_items)]
    return msgspec.defstruct(f"BoundedList{max_items}", fields, array_like=True, forbid_unknown_fields=True)


def items(value: msgspec.Struct) -> list:
    """The elements a ``bounded_list`` type decoded (its set fields come first, the unset ones last)."""
    values = msgspec.structs.astuple(value)
    low, high = 0, len(values)
    while low < high:  # the first unset field
        middle = (low + high) // 2
        if values[middle] is msgspec.UNSET:
            high = middle
        else:
            low = middle + 1
    return list(values[:low])


def too_deep_field(body: bytes) -> str | None:
    """The top-level field of the JSON object ``body`` whose value msgspec refuses as nested too
    deeply (``RecursionError``), or None when that cannot be told (not an object, malformed, more
    than ``MAX_TOP_LEVEL_FIELDS`` fields before it).  Each field is measured by msgspec itself, in C
    and without building its value, so this costs about one decode of the body."""
    data = memoryview(body)
    pos = _skip_whitespace(data, 0)
    if pos >= len(data) or data[pos] != ord("{"):
        return None
    pos += 1
    for _ in range(MAX_TOP_LEVEL_FIELDS):
        pos = _skip_whitespace(data, pos)
        end = _value_end(_key, data, pos)
        if end is None:
            return None
        name = _key.decode(data[pos:end])
        pos = _skip_whitespace(data, end)
        if pos >= len(data) or data[pos] != ord(":"):
            return None
        pos = _skip_whitespace(data, pos + 1)
        try:
            end = _value_end(_raw, data, pos)
        except RecursionError:
            return name
        if end is None:
            return None
        pos = _skip_whitespace(data, end)
        if pos >= len(data) or data[pos] != ord(","):
            return None
        pos += 1
    return None


def _value_end(decoder: msgspec.json.Decoder, data: memoryview, start: int) -> int | None:
    """Where the JSON value at ``start`` ends (the index of the first byte after it that is no
    whitespace: msgspec names it, counting from 1, in its "trailing characters" error), or None
    when there is no such value."""
    try:
        decoder.decode(data[start:])
    except msgspec.DecodeError as exc:
        if m := _TRAILING_RE.search(str(exc)):
            return start + int(m.group(1)) - 1
        return None
    return len(data)  # the value runs to the end: no closing brace follows


def _skip_whitespace(data: memoryview, pos: int) -> int:
    m = _NOT_WHITESPACE_RE.search(data, pos)
    return m.start() if m else len(data)
