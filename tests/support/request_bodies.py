"""OpenAI request bodies for the protocol tests, and the check that a body is a 400 naming a field."""
from __future__ import annotations

import json

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
