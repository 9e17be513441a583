"""What a request allows before sampling: its logit bias, its ``min_tokens``, its grammar.

Applied to a step's raw logits, in place, before penalties, temperature and the top-k/top-p/min-p
filters (and before greedy's argmax), in this order:

    grammar        logits[row, not allowed] = -inf  (``structured.masking``: one bitmask per row)
    logit_bias     logits[row, id] += bias          (one sparse index_add over the batch)
    min_tokens     logits[row, stop ids] = -inf     while the row has fewer outputs than min_tokens
                                                    (a grammar row: unless its grammar allows nothing else)

Logprobs are those of the logits after the grammar's mask, before the bias and the min_tokens ban,
as vLLM's by default (its structured-output mask applies before its sampler, which takes its
``raw_logprobs`` before the logits processors): a token the grammar forbids has -inf, a biased
token its model's logprob.  ``apply_logit_rules`` keeps those logits apart where they differ.
"""
from __future__ import annotations

from typing import Sequence

import torch

from common.engine.structured.masking import TokenMasks


def needs_rules(rows: Sequence) -> bool:
    return any(_rules_of(row) for row in rows)


def _rules_of(row) -> bool:
    p = row.sampling_params
    return bool(p.logit_bias) or _holds_stops(row) or row.grammar is not None


def _holds_stops(row) -> bool:
    return row.num_output_tokens < row.sampling_params.min_tokens and bool(row.stop_token_ids)


def apply_logit_rules(logits: torch.Tensor, rows: Sequence, masks: TokenMasks) -> torch.Tensor | None:
    """Apply every row's rules to ``logits`` [rows, vocab] in place.  Where a row asking for logprobs
    has a bias or a ban, return the logits of the rows asking for logprobs, in order, as the grammar's
    mask left them (the module's docstring: what their logprobs are read from); else None (read them
    from ``logits``).  (A grammar row's ban is its mask's: held stop tokens read -inf there.)"""
    vocab = logits.shape[1]
    flat = logits.view(-1)
    bias_index, bias_value, banned = [], [], []
    grammar_rows, matchers, grammar_stops, holding = [], [], [], []
    for i, row in enumerate(rows):
        p = row.sampling_params
        for token_id, bias in p.logit_bias:
            if token_id < vocab:
                bias_index.append(i * vocab + token_id)
                bias_value.append(bias)
        if row.grammar is not None:  # its mask bans the stop tokens itself (see TokenMasks.apply)
            grammar_rows.append(i)
            matchers.append(row.grammar)
            grammar_stops.append(tuple(row.stop_token_ids))
            holding.append(_holds_stops(row))
        elif _holds_stops(row):
            banned.extend(i * vocab + t for t in row.stop_token_ids if t < vocab)
    device = logits.device
    if grammar_rows:
        masks.apply(logits, grammar_rows, matchers, grammar_stops, holding)
    for_logprobs = None
    if bias_index or banned:  # (only then can a row's logprobs differ from its sampled logits)
        asking = [i for i, row in enumerate(rows) if row.sampling_params.logprobs is not None]
        if any(rows[i].sampling_params.logit_bias or _holds_stops(rows[i]) for i in asking):
            for_logprobs = logits[asking]  # (indexing by a list copies)
    if bias_index:
        flat.index_add_(0, torch.tensor(bias_index, device=device),
                        torch.tensor(bias_value, dtype=logits.dtype, device=device))
    if banned:
        flat[torch.tensor(banned, device=device)] = float("-inf")
    return for_logprobs
