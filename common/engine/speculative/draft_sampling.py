"""A draft model's drafts for sampled requests: its own distribution sampled with the uniform number
the target's row will sample with, by the target sampler's own rule.

The sampler (``common.engine.sampler``) turns a random row's one uniform number u into a token by an
inverse CDF: over the columns in order for a plain row (temperature alone) and for a top-p-only
row (over its nucleus), over the tokens sorted by probability for a row with top-k or min-p.
Verification keeps a draft while it equals the token its row samples (``verify``).  A greedy draft
is kept with the probability the target gives it: on text sampled at temperature 1 a few percent.
A draft that maps the same u through the draft's distribution by the same rule is kept whenever
both distributions send u to the same token -- for a draft close to the target (the target
quantized) nearly always.

Exact whatever the draft: each emitted token is still the target's sample with its row's u, so a
seeded row takes its u from (seed, output index) as it does without drafts (``seeded_uniform``),
and an unseeded row's u are drawn here, before the drafts, and handed to its rows
(``ScheduledRequest.draft_uniforms``): each is independent of the tokens before its position, so
every kept token is distributed as the target says.  Logit bias and min_tokens are left out of the
draft's distribution (they can only cost acceptance).
"""
from __future__ import annotations

import torch

from common.engine.inverse_cdf import seeded_uniform
from common.engine.sampling_params import SamplingParams


def samples_randomly(params: SamplingParams) -> bool:
    """Whether the sampler draws this row's token with a uniform number (else its argmax)."""
    return not (params.greedy or params.top_k == 1)


def draft_uniforms(params: SamplingParams, first_output_index: int, count: int) -> list[float] | None:
    """The uniform numbers of a request's next ``count`` rows (output indices from
    ``first_output_index``), or ``None`` for a greedy request (greedy drafts)."""
    if not samples_randomly(params):
        return None
    if params.seed is not None:
        return [seeded_uniform(params.seed, first_output_index + i) for i in range(count)]
    return torch.rand(count, dtype=torch.float64).tolist()


def sample_like_target(logits: torch.Tensor, params: SamplingParams, uniform: float,
                       vocab_size: int | None = None) -> int:
    """The index the target sampler would pick from ``logits`` (one row, fp32, its tokens in
    ascending id order; a token left out of it counts as having no probability) with ``uniform``;
    ``vocab_size``: the target's (whether a top-k filters at all), where ``logits`` hold fewer."""
    e = logits.float() - logits.max()
    if params.temperature != 1.0:
        e = e / params.temperature
    e = e.exp()
    vocab = e.numel()
    top_k = params.top_k if 0 < params.top_k < (vocab_size or vocab) else 0
    if not top_k and params.min_p <= 0.0:
        if params.top_p < 1.0:  # the nucleus, then its tokens in column order (``sample_wide_nucleus``)
            sorted_e = e.sort(descending=True, stable=True).values
            before = sorted_e.double().cumsum(0) - sorted_e.double()
            kept = int((before < params.top_p * float(e.double().sum())).sum())
            e = torch.where(e >= sorted_e[max(kept, 1) - 1], e, torch.zeros((), dtype=e.dtype))
        return _inverse_cdf(e.double().cumsum(0), uniform)
    # top-k and / or min-p (top-p after them): the tokens by probability (``Sampler._sample_filtered``)
    ids = torch.arange(vocab)
    if params.min_p > 0.0:
        candidates = e >= params.min_p
        e, ids = e[candidates], ids[candidates]
    table, order = e.sort(descending=True, stable=True)
    cumulative = table.double().cumsum(0)
    k = min(top_k, len(table)) if top_k else len(table)
    before = cumulative - table.double()
    kept = min(k, int((before[:k] < params.top_p * float(cumulative[k - 1])).sum()))
    return int(ids[order[_inverse_cdf(cumulative[: max(kept, 1)], uniform)]])


def _inverse_cdf(cumulative: torch.Tensor, uniform: float) -> int:
    """The first index whose cumulative mass exceeds ``uniform`` of the total, never past the last
    token with any."""
    index = int(torch.searchsorted(cumulative, torch.tensor([uniform * float(cumulative[-1])], dtype=cumulative.dtype),
                                   right=True)[0])
    last = int(torch.searchsorted(cumulative, cumulative[-1:], right=False)[0])  # first index reaching the total
    return min(index, last)
