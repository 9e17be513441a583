"""OpenAI request bodies for the protocol tests, and the check that a body is a 400 naming a field."""
from __future__ import annotations

import json
import tracemalloc

import pytest

from gateway.openai_protocol import OpenAIError


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def completion(**fields) -> bytes:
    return body(**{"model": "m", "prompt": "Hello", **fields})


def chat(**fields) -> bytes:
    return body(**{"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields})


def rejects(parse, raw: bytes, param: str | None, text: str) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse(raw)
    err = info.value
    assert err.status == 400 and err.type == "invalid_request_error"
    assert err.param == param, err.message
    assert text in err.message, err.message
    return err


def refuses_naming(parse, body: dict, param: str, code: str | None) -> None:
    """``parse(**body)`` is a 400 naming ``param`` (and with ``code``, of that code)."""
    with pytest.raises(OpenAIError) as info:
        parse(**body)
    assert (info.value.status, info.value.param) == (400, param), info.value.message
    if code is not None:
        assert info.value.code == code, info.value.message


MIB = 1 << 20


def many(item: bytes, size: int = 4 * MIB - 512) -> bytes:
    """A JSON array of ``item`` repeated to about ``size`` bytes."""
    return b"[" + b",".join([item] * (size // (len(item) + 1))) + b"]"


def with_fields(fields: dict[str, bytes]) -> bytes:
    """A JSON object of fields already in JSON (at most 4 MiB: a body the gateway reads)."""
    raw = b"{" + b", ".join(b'"%s": %s' % (k.encode(), v) for k, v in fields.items()) + b"}"
    assert len(raw) <= 4 * MIB
    return raw


def rejects_lightly(parse, raw: bytes, param: str, text: str, field: str) -> None:
    """``parse(raw)`` is a 400 naming ``param`` (its message holding ``text``), refused without building
    an object per element: the peak allocation stays under a quarter of the body."""
    tracemalloc.start()
    try:
        with pytest.raises(OpenAIError) as info:
            parse(raw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.status == 400 and info.value.param == param and text in info.value.message, info.value.message
    assert peak < len(raw) // 4, f"decoding {field} allocated {peak / MIB:.1f} MiB"
