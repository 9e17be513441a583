"""The ``prompt`` of ``/v1/completions``: its shape told apart from its first bytes, its size
checked before any element is decoded, its elements decoded and checked in C.  The result is the
request's prompts, one or a batch (each prompt's ``n`` choices are generated; a batch's choice
``p * n + i`` is choice ``i`` of prompt ``p``, as in vLLM and OpenAI's API):

    "text"                     -> ["text"]                  (the text decoder)
    [1, 2, 3]                  -> [[1, 2, 3]]               (elements counted by their commas first,
                                                             whatever values follow the first: more
                                                             than the context allows is a 400 before
                                                             any is decoded; then the token-id
                                                             decoder: ints in range)
    ["a", "b"]                 -> ["a", "b"]                (strings counted one by one first: more
                                                             than MAX_REQUEST_CHOICES is a 400 before
                                                             any is decoded)
    [[1, 2], [3]]              -> [[1, 2], [3]]             (lists counted by their brackets, each
                                                             list's ids by its commas, first)
    [], "", [""], [[]], ["a", [1]], anything else -> 400 naming ``prompt``

The request body is decoded with ``prompt`` as ``msgspec.Raw`` (its bytes, checked as JSON, no
Python objects), so no shape of prompt makes the gateway build or walk a tree of Python objects on
its event loop (``prompt: str | list[Any]`` did: 4 MiB of nested lists cost over a second).
"""
from __future__ import annotations

import re
from typing import Annotated

import msgspec

from common.engine.sampling_params import MAX_TOKEN_ID
from gateway.openai_errors import invalid, split_error_path

# A request's choices -- its prompts times ``n`` -- at most: each is a sequence the workers generate,
# all admitted as one request.
MAX_REQUEST_CHOICES = 32
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
# Lax as every integer field of the API: 16.0 and "16" are the token id 16 (openai_protocol.py).
_tokens = msgspec.json.Decoder(list[TokenId], strict=False)
_token_lists = msgspec.json.Decoder(list[list[TokenId]], strict=False)
_text = msgspec.json.Decoder(str)
_texts = msgspec.json.Decoder(list[str])
_WHITESPACE = b" \t\r\n"
# One string of a list and what follows it (a comma or the list's end), JSON whitespace around it.
_STRING_ITEM = re.compile(rb'[ \t\r\n]*"[^"\\]*(?:\\.[^"\\]*)*"[ \t\r\n]*([,\]])', re.S)
_SHAPES = (f"a string, a list of token ids (integers in [0, {MAX_TOKEN_ID}]), or a batch: a list of strings or "
           "of token-id lists")


def _first_byte(data: memoryview, start: int) -> tuple[int, int | None]:
    """``(index, byte)`` of the first byte at or after ``start`` that is not JSON whitespace
    (``byte`` None when there is none)."""
    for i in range(start, min(len(data), start + 64)):  # JSON allows any whitespace; 64 bytes is plenty
        if data[i] not in _WHITESPACE:
            return i, data[i]
    rest = bytes(data[start:])
    stripped = rest.lstrip(_WHITESPACE)
    return start + len(rest) - len(stripped), stripped[0] if stripped else None


def decode_prompt(raw: msgspec.Raw, max_prompt_tokens: int) -> list[str | list[int]]:
    """The request's prompts (one, or a batch), each text or token ids; raises ``OpenAIError``
    (400, ``param="prompt"``).  ``max_prompt_tokens``: the most prompt tokens the model's context
    holds; a longer list of token ids, or a batch of more than ``MAX_REQUEST_CHOICES`` prompts, is refused
    before any element is decoded."""
    data = memoryview(raw)
    start, first = _first_byte(data, 0)
    if first == ord('"'):
        return [_non_empty(_text.decode(raw), "prompt")]
    if first != ord("["):
        raise invalid(f"prompt must be {_SHAPES}", "prompt")
    _, inner = _first_byte(data, start + 1)
    if inner == ord("]"):
        raise invalid("prompt must not be empty", "prompt")
    if inner == ord('"'):
        _count_strings(bytes(data), start)
        return [_non_empty(text, f"prompt[{i}]") for i, text in enumerate(_decode(_texts, raw))]
    if inner == ord("["):
        _check_lists(bytes(data), max_prompt_tokens)
        return [_non_empty(ids, f"prompt[{i}]") for i, ids in enumerate(_decode(_token_lists, raw))]
    _check_count(bytes(data), max_prompt_tokens, "your prompt")
    return [_decode(_tokens, raw)]


def _decode(decoder: msgspec.json.Decoder, raw: msgspec.Raw):
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        detail, path = split_error_path(str(exc))
        where = f"prompt{path}: " if path else ""
        raise invalid(f"prompt must be {_SHAPES}; {where}{detail}", "prompt") from None


def _non_empty(prompt, name: str):
    if not prompt:
        raise invalid(f"{name} must not be empty", "prompt")
    return prompt


def _too_many() -> Exception:
    return invalid(f"a batch holds at most {MAX_REQUEST_CHOICES} prompts (a request's prompts times n are at most "
                   f"{MAX_REQUEST_CHOICES}); send the rest in another request", "prompt")


def _count_strings(data: bytes, start: int) -> None:
    """A batch of strings (its ``[`` at ``start``) holds at most ``MAX_REQUEST_CHOICES``: counted, a string
    at a time, before any is decoded.  A value that is not a string ends the count (the decoder
    then names it)."""
    position = start + 1
    for _ in range(MAX_REQUEST_CHOICES):
        match = _STRING_ITEM.match(data, position)
        if match is None or match.group(1) == b"]":
            return
        position = match.end()
    raise _too_many()


def _check_lists(data: bytes, max_prompt_tokens: int) -> None:
    """A batch of token-id lists: at most ``MAX_REQUEST_CHOICES`` lists (counted by their brackets),
    each within the context (``_check_count`` on the span up to its first ``]``), before any id is
    decoded.  Brackets of deeper lists make the counts upper bounds: such a batch holds no token
    ids anyway."""
    lists = data.count(b"[") - 1
    if lists > MAX_REQUEST_CHOICES:
        raise _too_many()
    position = data.find(b"[") + 1
    for i in range(lists):
        opening = data.find(b"[", position)
        closing = data.find(b"]", opening + 1)
        if opening < 0 or closing < 0:
            return
        _check_count(data, max_prompt_tokens, f"prompt[{i}]", opening, closing + 1)
        position = closing + 1


def _check_count(data: bytes, max_prompt_tokens: int, name: str, start: int = 0, end: int | None = None) -> None:
    """A list of token ids (``data[start:end]``) has as many elements as commas plus one: more than
    the context holds is refused before any element is decoded, whatever follows the first one.
    Commas inside strings, objects or nested lists make the count an upper bound, so a list holding
    such values (invalid as token ids anyway) is refused as too long without claiming a token
    count."""
    end = len(data) if end is None else end
    count = data.count(b",", start, end) + 1
    if count <= max_prompt_tokens:
        return
    numbers_only = data.find(b'"', start, end) < 0 and data.find(b"{", start, end) < 0 \
        and data.count(b"[", start, end) == 1
    if numbers_only:  # the count is exact
        raise invalid(f"This model's maximum context length is {max_prompt_tokens} tokens. However, {name} "
                      f"has {count} tokens. Please reduce the prompt.", "prompt", "context_length_exceeded")
    raise invalid(f"This model's maximum context length is {max_prompt_tokens} tokens. However, {name}'s list "
                  f"has {count} comma-separated parts. Please reduce the prompt.", "prompt")
