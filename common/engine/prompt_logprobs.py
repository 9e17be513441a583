"""Prompt logprobs: each prompt token's log-probability given the tokens before it, and its top
alternatives -- what ``echo`` with ``logprobs`` answers on /v1/completions (OpenAI's legacy API, as
vLLM serves it: scoring text, multiple-choice evaluations).

They are computed with the prompt, chunk by chunk: the final hidden state at position ``p``
predicts token ``p + 1``, so a chunk over positions ``[start, start + n)`` scores the prompt
tokens ``start + 1 .. start + n`` (the prompt's last position predicts the first output token:
that one is sampled, not scored).  Entry ``i`` of a request's list scores prompt token ``i + 1``;
the first prompt token has none (nothing precedes it).

A request that asks for them never reads the prefix cache (a cached block's positions would have
no hidden states here); a preempted one keeps what it scored and computes its prompt again
without scoring it twice (``scored_rows``).  The rows are projected to the vocabulary a few at a
time, so a long prompt chunk never holds its whole [tokens, vocabulary] logits.
"""
from __future__ import annotations

import torch

from common.engine.sampler import TokenLogprobs

ROWS_PER_PASS = 64  # rows projected at once: a 262k vocabulary's logits for 64 rows are 64 MiB of fp32
# A logprob that is not a finite number (a row of NaN logits) is reported as the lowest finite
# float: every logprob in an answer is a finite JSON number.
_FLOOR = torch.finfo(torch.float32).min


def scored_rows(prompt_len: int, start: int, num_new: int, scored: int) -> tuple[int, int]:
    """The offsets ``[begin, end)`` within a step's slice (positions ``start .. start + num_new``)
    whose rows score prompt tokens not scored yet (``scored`` are: tokens ``1 .. scored``, by
    positions ``0 .. scored - 1``); ``(0, 0)`` where none."""
    first, last = max(start, scored), min(start + num_new, prompt_len - 1)
    return (first - start, last - start) if first < last else (0, 0)


def score(logits_of, hidden: torch.Tensor, targets: list[int] | None, top: int) -> list[TokenLogprobs]:
    """The ``TokenLogprobs`` of ``targets[i]`` at row ``i`` of ``hidden`` (final hidden states,
    before the norm: ``logits_of`` is the model's ``logits``) with the ``top`` most likely tokens.
    ``targets`` None: a tensor-parallel rank other than 0, which takes part in the projections
    (``logits_of`` gathers the vocabulary on rank 0) and returns nothing.  Three passes over a
    pass's logits (the normalizer, the rank, the top tokens); the log-softmax is taken of the few
    values kept, not of the whole rows."""
    entries: list[TokenLogprobs] = []
    for begin in range(0, hidden.shape[0], ROWS_PER_PASS):
        logits = logits_of(hidden[begin:begin + ROWS_PER_PASS])
        if targets is None:
            continue
        logits = logits.float()
        normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)
        chosen = torch.tensor(targets[begin:begin + ROWS_PER_PASS], device=logits.device)
        chosen_logits = logits.gather(1, chosen[:, None])
        ranks = (1 + (logits > chosen_logits).sum(dim=-1)).tolist()  # 1: the most likely token
        top_logits, top_ids = logits.topk(top, dim=-1) if top else (logits[:, :0], logits[:, :0].long())
        values, top_values = (_finite(v - normalizer).tolist() for v in (chosen_logits, top_logits))
        for token, value, rank, ids, tops in zip(chosen.tolist(), values, ranks, top_ids.tolist(), top_values):
            entries.append(TokenLogprobs(token, value[0], list(zip(ids, tops)), rank))
    return entries


def _finite(logprobs: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(logprobs, nan=_FLOOR, neginf=_FLOOR, posinf=0.0)
