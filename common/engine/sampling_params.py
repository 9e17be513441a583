"""Per-request sampling parameters, validated wherever they enter a process.

The gateway checks the same ranges on the OpenAI fields (a 400 naming the field); a worker checks
them again when it decodes a peer's message, because peers are not trusted to have done so.
"""
from __future__ import annotations

import math
from typing import Any

from common.engine.structs import Struct, convert
from common.engine.structured.spec import StructuredOutput

MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # entries (OpenAI's bound)
MAX_LOGIT_BIAS_VALUE = 100.0
MAX_TOKEN_ID = 2**31 - 1
MAX_TOKENS = 2**31 - 1
MAX_TEMPERATURE = 2.0
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_REPETITION_PENALTY = 10.0
# Below this a temperature means greedy, as in vLLM: dividing logits by it overflows fp32.
GREEDY_TEMPERATURE = 1e-5
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Prompt logprobs a request may ask for, its prompt's tokens times (1 + alternatives): their entries
# travel in one message (a PrefillResult, a TokenFrame: ~15 bytes a value, under MAX_FRAME_BYTES).
MAX_PROMPT_LOGPROB_VALUES = 1 << 17


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _finite_in(name: str, value: float, low: float, high: float, *, low_open: bool = False) -> None:
    below = value <= low if low_open else value < low
    _require(math.isfinite(value) and not below and value <= high,
             f"{name} must be {'>' if low_open else '>='} {low:g} and <= {high:g}, got {value}")


class SamplingParams(Struct, forbid_unknown_fields=True, frozen=True):
    """How to turn logits into tokens, and when to stop.

    ``temperature`` below ``GREEDY_TEMPERATURE`` (0 included) means greedy.  ``top_k == 0`` disables
    top-k, and a ``top_k`` at or above the vocabulary size is the same as none (the sampler clamps
    it, as vLLM does).  ``top_p == 1`` disables top-p.  ``min_p`` drops tokens less likely than
    ``min_p`` times the most likely one.  ``presence_penalty`` / ``frequency_penalty`` (OpenAI's)
    subtract from the logit of every token already generated, once / once per occurrence;
    ``repetition_penalty`` (vLLM's and transformers') divides positive and multiplies negative
    logits of tokens in the prompt or the output.  Penalties apply to greedy requests too.
    ``seed`` makes random sampling reproducible per request: a draw depends only on the seed and
    the output position.  ``logprobs`` asks for the sampled token's log-probability plus the
    top-``logprobs`` alternatives.  ``logit_bias`` adds ``bias`` to token ``id``'s logit for each
    ``(id, bias)`` (±100 bans or forces a token).  ``min_tokens``: no stop token (EOS included)
    may end the output before it has that many tokens.  ``structured``: the output must match
    this grammar (every sampled token is masked to what it allows).  ``prompt_logprobs``: each
    prompt token's log-probability given the tokens before it, plus the top-``prompt_logprobs``
    alternatives (``common.engine.prompt_logprobs``; the prompt is then computed whole, never read
    from the prefix cache).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    structured: StructuredOutput | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        _require(1 <= self.max_tokens <= MAX_TOKENS, f"max_tokens must be >= 1 and <= {MAX_TOKENS}, got {self.max_tokens}")
        _finite_in("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _require(0 <= self.top_k <= MAX_TOKEN_ID, f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        _require(math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _finite_in("min_p", self.min_p, 0.0, 1.0)
        _finite_in("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _finite_in("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        _finite_in("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, low_open=True)
        _require(self.seed is None or INT64_MIN <= self.seed <= INT64_MAX,
                 f"seed must fit in a signed 64-bit integer, got {self.seed}")
        _require(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                 f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        _require(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                 f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        _require(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed")
        _require(all(0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids),
                 f"stop_token_ids must be in [0, {MAX_TOKEN_ID}]")
        _require(len(self.logit_bias) <= MAX_LOGIT_BIAS, f"at most {MAX_LOGIT_BIAS} logit_bias entries are allowed")
        for token_id, bias in self.logit_bias:
            _require(0 <= token_id <= MAX_TOKEN_ID, f"logit_bias token ids must be in [0, {MAX_TOKEN_ID}]")
            _finite_in("a logit_bias value", bias, -MAX_LOGIT_BIAS_VALUE, MAX_LOGIT_BIAS_VALUE)
        _require(0 <= self.min_tokens <= self.max_tokens,
                 f"min_tokens must be >= 0 and <= max_tokens ({self.max_tokens}), got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def takes_argmax(self) -> bool:
        """Greedy or top-k 1: the sampler takes the row's argmax and draws no uniform number."""
        return self.greedy or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        """Repetition, frequency or presence penalties: sampling reads the request's token history."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> "SamplingParams":
        """Build from untrusted input; unknown or mistyped fields raise ``ValueError`` naming them."""
        try:
            return convert(fields, cls)
        except ValueError as exc:
            raise ValueError(f"invalid sampling parameters: {exc}") from None


def check_prompt_logprobs(num_prompt_tokens: int, prompt_logprobs: int | None) -> None:
    """``ValueError`` where scoring a prompt of ``num_prompt_tokens`` with ``prompt_logprobs``
    alternatives a token would exceed ``MAX_PROMPT_LOGPROB_VALUES``."""
    if prompt_logprobs is not None and num_prompt_tokens * (1 + prompt_logprobs) > MAX_PROMPT_LOGPROB_VALUES:
        raise ValueError(f"prompt logprobs for {num_prompt_tokens} prompt tokens with {prompt_logprobs} alternatives "
                         f"each are {num_prompt_tokens * (1 + prompt_logprobs)} values; at most "
                         f"{MAX_PROMPT_LOGPROB_VALUES} are served (fewer alternatives, or a shorter prompt)")
