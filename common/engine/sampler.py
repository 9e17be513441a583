"""Turn logits into tokens: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from common.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class TokenLogprobs:
    """The sampled token's log-probability and the ``n`` most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def _seeded_generator(seed: int, step: int, device) -> torch.Generator:
    # Seeding from (seed, output index) makes a request's draws independent of batch composition,
    # preemption, and of which worker samples which token.
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + step) & 0xFFFF_FFFF_FFFF_FFFF)
    return generator


def _filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:  # a top_k at or above the vocabulary size is no top-k
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(-1)
        # Keep the smallest set whose mass reaches top_p (the first token is always kept).
        drop = cumulative - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs


def sample(
    logits: torch.Tensor, params: list[SamplingParams], output_index: list[int]
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Sample one token per row of ``logits`` [rows, vocab] (fp32).

    ``output_index[i]`` is how many tokens row ``i``'s request has produced so far (for seeds).
    """
    tokens = logits.argmax(dim=-1)
    # A row whose maximum is not finite holds NaN or +inf (or only -inf): it gets the argmax over its
    # finite values and is never sampled, so it cannot make the sampler raise.
    bad = ~torch.isfinite(logits.amax(dim=-1))
    if bad.any():
        rows = logits[bad]
        tokens[bad] = rows.masked_fill(~torch.isfinite(rows), float("-inf")).argmax(dim=-1)
    bad_rows = set(bad.nonzero().flatten().tolist())
    random_rows = [i for i, p in enumerate(params) if not p.greedy and i not in bad_rows]
    for i in random_rows:
        p = params[i]
        try:
            probs = _filtered_probs(logits[i], p)
            generator = _seeded_generator(p.seed, output_index[i], logits.device) if p.seed is not None else None
            tokens[i] = torch.multinomial(probs, 1, generator=generator)[0]
        except RuntimeError as exc:  # a degenerate distribution: this row falls back to its argmax
            log.warning("sampling row %d failed (%s); using its argmax", i, exc)
    token_ids = tokens.tolist()

    logprobs: list[TokenLogprobs | None] = [None] * len(params)
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if wanted:
        log_probs = torch.log_softmax(logits[wanted], dim=-1)
        for row, i in enumerate(wanted):
            n = params[i].logprobs
            top_values, top_ids = torch.topk(log_probs[row], n) if n else (torch.empty(0), torch.empty(0))
            logprobs[i] = TokenLogprobs(
                token_id=token_ids[i],
                logprob=float(log_probs[row, token_ids[i]]),
                top=list(zip(top_ids.tolist(), top_values.tolist())),
            )
    return token_ids, logprobs
