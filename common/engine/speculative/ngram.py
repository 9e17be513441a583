"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the
request's last n tokens (n from ``max_n`` down to ``min_n``: the longest match wins, then the
latest), searched in the last ``window`` tokens.  Answers that repeat spans of their prompt (code
edits, quotes, retrieval answers) are proposed their next tokens for free.

    tokens  [ ... a b c X Y Z ... ... a b c ]      suffix "a b c" matches at the earlier "a b c"
                      ^^^^^^^ proposed               -> propose "X Y Z"

The search is vectorised (numpy): candidate end positions are those holding the last token, then
filtered one token further back at a time while any survive.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class _Tokens:
    """One request's token ids as a growing numpy buffer (only new tokens are copied in)."""

    buffer: np.ndarray = field(default_factory=lambda: np.empty(256, dtype=np.int64))
    length: int = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        n = len(token_ids)
        if n < self.length:  # not the same request's tokens any more
            self.length = 0
        if n > self.buffer.size:
            grown = np.empty(max(2 * n, 256), dtype=np.int64)
            grown[: self.length] = self.buffer[: self.length]
            self.buffer = grown
        if n > self.length:
            self.buffer[self.length : n] = token_ids[self.length :]
            self.length = n
        return self.buffer[:n]


class NgramProposer:
    """Proposes up to ``num_tokens`` draft tokens per request from its own token history."""

    def __init__(self, min_n: int, max_n: int, window: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n}..{max_n}")
        if window <= max_n:
            raise ValueError(f"the lookup window ({window}) must be longer than the largest n-gram ({max_n})")
        self.min_n = min_n
        self.max_n = max_n
        self.window = window
        self._tokens: dict[str, _Tokens] = {}

    def propose(self, request, num_tokens: int, block_ids=None) -> list[int]:
        """Up to ``num_tokens`` tokens likely to follow ``request``'s tokens (prompt + output so far)."""
        token_ids = request.all_token_ids
        if num_tokens <= 0 or len(token_ids) <= self.min_n:
            return []
        history = self._tokens.setdefault(request.request_id, _Tokens()).sync(token_ids)
        return propose_from(history[-self.window :], self.min_n, self.max_n, num_tokens)

    def forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)


def propose_from(tokens: np.ndarray, min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """The lookup on one token array (see the module docstring)."""
    last = tokens.size - 1
    if last < min_n:
        return []
    # Ends of earlier occurrences of the last token (never the last position itself).
    ends = np.flatnonzero(tokens[:last] == tokens[last])
    matched = 1
    while ends.size and matched < max_n and matched <= last:
        back = ends[ends >= matched]
        back = back[tokens[back - matched] == tokens[last - matched]]
        if not back.size:
            break
        ends, matched = back, matched + 1
    if not ends.size or matched < min_n:
        return []
    start = int(ends[-1]) + 1  # the latest of the longest matches
    return tokens[start : start + num_tokens].tolist()
