"""A token's bytes in logprobs (gateway/token_bytes.py): the bytes of the tokens of a text joined are the
text's UTF-8, though a token decoded alone holds part of a character only -- with a byte-level BPE
tokenizer (the tiny checkpoints', Llama 3's, Qwen's) and SentencePiece's byte fallback (Gemma's)."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from gateway.token_bytes import token_bytes
from tests.support.checkpoints import write_tokenizer


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    return AutoTokenizer.from_pretrained(write_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.mark.parametrize("text", ["naïve 日本語 🙂", "€"])
def test_a_texts_tokens_bytes_joined_are_its_utf8_with_a_byte_level_tokenizer(byte_level, text):
    ids = byte_level(text, add_special_tokens=False).input_ids
    pieces = [byte_level.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)  # (some token splits a character)
    assert bytes(b for i, p in zip(ids, pieces) for b in token_bytes(byte_level, i, p)) == text.encode()


class ByteFallback:
    """SentencePiece's pieces: a character its vocabulary lacks is spelled a byte a piece."""

    PIECES = {5: "▁Hi", 6: "<0xF0>", 7: "<0x9F>", 8: "<0x99>", 9: "<0x82>"}

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.PIECES[token_id]


def test_byte_fallback_pieces_are_their_bytes():
    tokenizer = ByteFallback()
    assert token_bytes(tokenizer, 5, " Hi") == list(b" Hi")
    assert bytes(b for i in (6, 7, 8, 9) for b in token_bytes(tokenizer, i, "\ufffd")) == "🙂".encode()
