"""A token's bytes as OpenAI's logprobs give them (``bytes``): a client joins a run of them to rebuild
text whose character a token splits -- which decoding that token alone cannot give (U+FFFD)."""
from __future__ import annotations

import re
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback (Gemma, Llama 2)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (Llama 3, Qwen, ...): the character a piece spells each byte with."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    alphabet, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(256 + shifted)] = byte
            shifted += 1
    return alphabet


_BYTE_LEVEL = _byte_level_alphabet()


def token_bytes(tokenizer: Any, token_id: int, text: str) -> list[int]:
    """``text`` (the token decoded alone) in UTF-8 -- or, where it is part of a character (decoded as
    U+FFFD), the bytes the tokenizer's piece stands for: a byte-fallback piece's byte, a byte-level
    piece's bytes."""
    if "\ufffd" in text:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece:
            if match := _BYTE_PIECE.fullmatch(piece):
                return [int(match.group(1), 16)]
            if all(c in _BYTE_LEVEL for c in piece):
                return [_BYTE_LEVEL[c] for c in piece]
    return list(text.encode())
