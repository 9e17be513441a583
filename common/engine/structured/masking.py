"""A step's grammar masks: each constrained row's allowed tokens, applied to the logits at once.

Rows fill their bitmask words (the backend, in C); the words are unpacked to a boolean
[rows, vocab] mask with one numpy call and applied with one ``masked_fill_`` over those rows.
Where a row's grammar lets the output end (its EOS bit is set), every stop token of the request is
allowed too (a chat model ends its turn with its own end-of-turn token, not the tokenizer's EOS).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from common.engine.structured.backend import GrammarMatcher, bitmask_words


class TokenMasks:
    """Reusable bitmask storage (grows to the largest batch of constrained rows seen)."""

    def __init__(self) -> None:
        self._words: torch.Tensor | None = None

    def _buffer(self, rows: int, vocab: int) -> torch.Tensor:
        words = bitmask_words(vocab)
        if self._words is None or self._words.shape[0] < rows or self._words.shape[1] != words:
            self._words = torch.empty(max(rows, 1), words, dtype=torch.int32)
        return self._words[:rows]

    def apply(self, logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[GrammarMatcher],
              stop_token_ids: Sequence[Sequence[int]]) -> None:
        """Mask ``logits[rows[i]]`` (in place) to what ``matchers[i]`` allows next."""
        vocab = logits.shape[1]
        words = self._buffer(len(rows), vocab)
        words.fill_(0)
        for i, matcher in enumerate(matchers):
            matcher.fill_bitmask(words, i)
        allowed = np.unpackbits(words.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        for i, stops in enumerate(stop_token_ids):
            inside = [t for t in stops if t < vocab]
            if inside and allowed[i, inside].any():
                allowed[i, inside] = 1
        forbidden = torch.from_numpy(allowed == 0).to(logits.device)
        index = torch.tensor(list(rows), device=logits.device)
        masked = logits.index_select(0, index).masked_fill_(forbidden, float("-inf"))
        logits.index_copy_(0, index, masked)
