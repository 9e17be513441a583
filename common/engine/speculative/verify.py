"""The runner's side of speculative decoding: a request scheduled with drafts ``d1 .. dk`` has k + 1
rows of logits; row i is sampled as if ``d1 .. di`` had been accepted (its output index moves on
by i), and the drafts are kept while they equal what their row sampled::

    rows     r0   r1   r2   r3          sampled  t0 t1 t2 t3,  drafts d1 d2 d3
    kept     t0 (= d1), t1 (= d2), t2   when t0 == d1, t1 == d2, t2 != d3

For a greedy row that is exactly what decoding one token at a time would produce.  For a random
row it is rejection sampling with a proposal that puts all its mass on the draft (n-gram drafts are
deterministic): the draft is accepted with the probability the model gives it, and on rejection the
row's own token is a sample of the model's distribution without the draft, renormalised, so every
kept token is distributed as the model says.  A seeded row draws from (seed, output index), so its
tokens are those it gets with speculation off.  A draft model samples its drafts with the uniform
numbers of the rows they are compared with (``draft_sampling``): the rows draw with those numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence

from common.engine.sampling_params import SamplingParams
from common.engine.structured.backend import GrammarMatcher


@dataclass
class DraftRow:
    """One row of a speculating request: the request's sampling, ``offset`` outputs further on."""

    request_id: str
    sampling_params: SamplingParams
    num_output_tokens: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    stop_token_ids: Collection[int]
    grammar: GrammarMatcher | None = None
    uniform: float | None = None  # the number it samples with, drawn with its draft (``draft_sampling``)


def num_rows(item) -> int:
    """Rows of logits a scheduled request needs: one, plus one per draft token."""
    return 1 + len(item.draft_token_ids)


def sampling_rows(items: Sequence) -> list:
    """The sampler's rows for ``items`` (sampling ``ScheduledRequest``s): an item without drafts is
    its own row; one with k drafts becomes k + 1 ``DraftRow``s."""
    rows = []
    for item in items:
        if not item.draft_token_ids:
            rows.append(item)
            continue
        uniforms = item.draft_uniforms
        rows.extend(DraftRow(item.request_id, item.sampling_params, item.num_output_tokens + i,
                             item.prompt_token_ids, item.output_token_ids, item.stop_token_ids,
                             uniform=uniforms[i] if i < len(uniforms) else None)
                    for i in range(num_rows(item)))
    return rows


def kept_tokens(items: Sequence, tokens: list[int], logprobs: list) -> dict[str, tuple[list[int], list]]:
    """``request_id -> (tokens, logprobs)`` kept per item, from the sampled ``tokens`` of the rows
    ``sampling_rows`` made (in order): the accepted drafts, then the first token of the model's own."""
    kept, row = {}, 0
    for item in items:
        drafts = item.draft_token_ids
        accepted = 0
        while accepted < len(drafts) and tokens[row + accepted] == drafts[accepted]:
            accepted += 1
        kept[item.request_id] = (tokens[row : row + accepted + 1], logprobs[row : row + accepted + 1])
        row += num_rows(item)
    return kept
