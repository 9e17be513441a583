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
every kept token is distributed as the target says.  The drafts are drawn by the target's sampler
itself (``sample_drafts``), over the draft's logits.
"""
from __future__ import annotations

import torch

from common.engine.inverse_cdf import seeded_uniform
from common.engine.sampler import Sampler, SamplingRow
from common.engine.sampling_params import SamplingParams
from common.engine.structs import replace


def draft_uniforms(params: SamplingParams, first_output_index: int, count: int) -> list[float] | None:
    """The uniform numbers of a request's next ``count`` rows (output indices from
    ``first_output_index``), or ``None`` for a greedy request (greedy drafts)."""
    if params.takes_argmax:
        return None
    if params.seed is not None:
        return [seeded_uniform(params.seed, first_output_index + i) for i in range(count)]
    return torch.rand(count, dtype=torch.float64).tolist()


def sample_drafts(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams],
                  uniforms: list[float], vocab_size: int) -> list[int]:
    """Each row's column of ``logits`` [rows, columns] (a part of the model's ``vocab_size`` tokens
    in ascending id order: a token left out has no probability) that ``sampler`` draws with its
    uniform number under its request's temperature and filters -- the target's own rule.  Logit bias
    and min_tokens, which name token ids, and logprobs are left out (they can only cost acceptance)."""
    rows = [SamplingRow(replace(p, logit_bias=(), min_tokens=0, logprobs=None), uniform=u)
            for p, u in zip(params, uniforms)]
    # A top-k the model's vocabulary filters by (tokens by probability) but this part would not
    # (the sampler ignores a top-k at or above its width): columns of no probability widen the part.
    width = max([p.top_k + 1 for p in params if 0 < p.top_k < vocab_size] + [logits.shape[1]])
    if width > logits.shape[1]:
        logits = torch.cat([logits, logits.new_full((logits.shape[0], width - logits.shape[1]), float("-inf"))], dim=1)
    return sampler(logits, rows, scratch_logits=True)[0]
