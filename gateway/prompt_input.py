"""The ``prompt`` of ``/v1/completions``: its shape told apart from its first bytes, its size
checked before any element is decoded, its elements decoded and checked in C.

    "text"                     -> str                       (the text decoder)
    [1, 2, 3]                  -> list[int]                 (elements counted by their commas first,
                                                             whatever values follow the first: more
                                                             than the context allows is a 400 before
                                                             any is decoded; then the token-id
                                                             decoder: ints in range)
    ["text"]                   -> str                       (a list of one string)
    ["a", "b"], [[1], [2]]     -> 400: batch prompts are not supported (a list of token lists is
                                                             refused without decoding it)
    [], "", anything else      -> 400 naming ``prompt``

The request body is decoded with ``prompt`` as ``msgspec.Raw`` (its bytes, checked as JSON, no
Python objects), so no shape of prompt makes the gateway build or walk a tree of Python objects on
its event loop (``prompt: str | list[Any]`` did: 4 MiB of nested lists cost over a second).
"""
from __future__ import annotations

from typing import Annotated

import msgspec

from common.engine.sampling_params import MAX_TOKEN_ID
from gateway.openai_errors import invalid, split_error_path

TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
# Lax as every integer field of the API: 16.0 and "16" are the token id 16 (openai_protocol.py).
_tokens = msgspec.json.Decoder(list[TokenId], strict=False)
_text = msgspec.json.Decoder(str)
_one_text = msgspec.json.Decoder(tuple[str])
_WHITESPACE = b" \t\r\n"


def _first_byte(data: memoryview, start: int) -> tuple[int, int | None]:
    """``(index, byte)`` of the first byte at or after ``start`` that is not JSON whitespace
    (``byte`` None when there is none)."""
    for i in range(start, min(len(data), start + 64)):  # JSON allows any whitespace; 64 bytes is plenty
        if data[i] not in _WHITESPACE:
            return i, data[i]
    rest = bytes(data[start:])
    stripped = rest.lstrip(_WHITESPACE)
    return start + len(rest) - len(stripped), stripped[0] if stripped else None


def decode_prompt(raw: msgspec.Raw, max_prompt_tokens: int) -> str | list[int]:
    """The prompt as text or token ids; raises ``OpenAIError`` (400, ``param="prompt"``).
    ``max_prompt_tokens``: the most prompt tokens the model's context holds; a longer list of
    token ids is refused before any element is decoded."""
    data = memoryview(raw)
    start, first = _first_byte(data, 0)
    if first == ord('"'):
        text = _text.decode(raw)
        if not text:
            raise invalid("prompt must not be empty", "prompt")
        return text
    if first != ord("["):
        raise invalid("prompt must be a string or a list of token ids", "prompt")
    _, inner = _first_byte(data, start + 1)
    if inner == ord("]"):
        raise invalid("prompt must not be empty", "prompt")
    if inner == ord("["):
        raise invalid("batch prompts are not supported (got a list of token lists); send one request per "
                      "prompt", "prompt", "unsupported_value")
    if inner == ord('"'):
        try:
            (text,) = _one_text.decode(raw)
        except msgspec.ValidationError:
            raise invalid("batch prompts are not supported (got a list of several strings, or of strings and "
                          "other values); send one request per prompt", "prompt", "unsupported_value") from None
        if not text:
            raise invalid("prompt must not be empty", "prompt")
        return text
    _check_count(bytes(data), max_prompt_tokens)
    try:
        return _tokens.decode(raw)
    except msgspec.ValidationError as exc:
        detail, path = split_error_path(str(exc))
        where = f"prompt{path}: " if path else ""
        raise invalid(f"prompt must be a string or a list of token ids (integers in [0, {MAX_TOKEN_ID}]); "
                      f"{where}{detail}", "prompt") from None


def _check_count(span: bytes, max_prompt_tokens: int) -> None:
    """A list of token ids has as many elements as commas plus one: more than the context holds is
    refused before any element is decoded, whatever follows the first one.  Commas inside strings,
    objects or nested lists make the count an upper bound, so a list holding such values (invalid
    as token ids anyway) is refused as too long without claiming a token count."""
    count = span.count(b",") + 1
    if count <= max_prompt_tokens:
        return
    if b'"' not in span and b"{" not in span and span.count(b"[") == 1:  # numbers only: the count is exact
        raise invalid(f"This model's maximum context length is {max_prompt_tokens} tokens. However, your prompt "
                      f"has {count} tokens. Please reduce the prompt.", "prompt", "context_length_exceeded")
    raise invalid(f"This model's maximum context length is {max_prompt_tokens} tokens. However, your prompt's list "
                  f"has {count} comma-separated parts. Please reduce the prompt.", "prompt")
