"""Per-request sampling parameters, validated once at the edge."""
from __future__ import annotations

from typing import Any

import msgspec

MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 64


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """How to turn logits into tokens, and when to stop.

    ``temperature == 0`` means greedy.  ``top_k <= 0`` disables top-k; ``top_p == 1`` disables
    top-p.  ``seed`` makes random sampling reproducible per request.  ``logprobs`` asks for the
    sampled token's log-probability plus the top-``logprobs`` alternatives.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> "SamplingParams":
        """Build from untrusted input; unknown or mistyped fields raise ``ValueError`` naming them."""
        try:
            return msgspec.convert(fields, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid sampling parameters: {exc}") from None
