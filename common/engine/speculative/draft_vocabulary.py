"""The tokens a draft model's head scores: a vocabulary's most common tokens and the tokens of the
requests it drafts for, rather than all of it (EAGLE-3's reduced draft vocabulary).

A greedy draft forward ends in the draft's LM head: for Gemma 3 (262,144 tokens, 640 wide) in int8
that is 168 MB read for every drafted token -- more than its 18 layers together: 4.2-4.7 ms a
forward on a 2-core Zen 5 VM (1-8 rows, from memory), where 32,768 rows of it take 0.63-0.71 ms.  Verification is exact whatever the draft proposes, so a smaller head costs only the
drafts it cannot make: a target token outside the draft's vocabulary ends that verification's
accepted run.

Which tokens: where no counts of real traffic are at hand, a BPE tokenizer's merges rank its
tokens -- merges are learnt most frequent pair first, so a token that takes part in an early merge
(as a part or as the result) is a common one: Gemma 3's first 32,768 by that rank cover 86% of an
English book's tokens and 88% of this repository's Python (its first 32,768 ids, 76% and 64%: its
ids put single characters last).  A Unigram tokenizer's pieces rank by their scores.  The model's
end-of-sequence tokens always belong.  And because drafts pay most where the answer repeats the
prompt (quotes, code edits), each request's own tokens join the vocabulary for its drafts: the rows
of the tokens it has that the common ones lack are scored beside them (dequantized, in fp32: a draft
need not match the target's rounding).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from common.engine.models.panels import LANES
from common.engine.models.quantized import quantize_weight
from common.engine.sampler import Sampler
from common.engine.speculative.draft_sampling import sample_drafts

log = logging.getLogger(__name__)

_MAX_OWN_TOKENS = 1024  # a request's tokens outside the common ones scored for its drafts, at most


def rank_tokens(checkpoint: Path) -> list[int] | None:
    """The checkpoint's token ids, most common first by its tokenizer's own ranking (see the module
    docstring), or ``None`` where ``tokenizer.json`` is missing or ranks nothing (a WordPiece
    vocabulary, a BPE one without merges)."""
    try:
        model = json.loads((checkpoint / "tokenizer.json").read_text())["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    vocab, kind = model.get("vocab"), model.get("type")
    if kind == "BPE" and isinstance(vocab, dict) and model.get("merges"):
        first_merge: dict[str, int] = {}
        for rank, merge in enumerate(model["merges"]):
            left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
            for piece in (left, right, left + right):
                first_merge.setdefault(piece, rank)
        ranked = sorted((rank, vocab[piece]) for piece, rank in first_merge.items() if piece in vocab)
        return [token for _, token in ranked]
    if kind == "Unigram" and isinstance(vocab, list):
        scored = sorted((-float(score), token) for token, (_, score) in enumerate(vocab))
        return [token for _, token in scored]
    return None


class DraftHead:
    """The drafts of a draft model's head over ``size`` common tokens and each request's own
    (``drafts``); ``size`` 0, or a vocabulary its tokenizer does not rank, scores every token."""

    def __init__(self, model, config, checkpoint: Path, size: int, scheme: str, group_size: int,
                 device: torch.device):
        self.model = model
        self.device = device
        self.vocab_size = config.vocab_size
        self.softcap = config.final_logit_softcapping
        self._sampler = Sampler()  # a sampled request's drafts are drawn by the target's rule
        ranking = rank_tokens(checkpoint) if 0 < size < config.vocab_size else None
        readable = ranking is not None and head_rows(model, torch.zeros(1, dtype=torch.long, device=device)) is not None
        # request -> (its tokens seen, those of them outside the common ones, their head rows in fp32)
        self._own: dict[str, tuple[int, torch.Tensor, torch.Tensor | None]] = {}
        if not readable:
            if size and size < config.vocab_size:
                log.info("draft vocabulary: %s's %s; the draft scores all %d tokens", checkpoint.name,
                         "tokenizer ranks no tokens" if ranking is None else "head's rows cannot be read",
                         config.vocab_size)
            self.ids = None
            return
        chosen = dict.fromkeys(token for token in config.eos_token_ids if 0 <= token < config.vocab_size)
        for token in ranking:
            if len(chosen) >= size:
                break
            if 0 <= token < config.vocab_size:
                chosen.setdefault(token)
        self.ids = torch.tensor(sorted(chosen), dtype=torch.long, device=device)
        self._ids_cpu = self.ids.cpu()
        self.common = torch.zeros(config.vocab_size, dtype=torch.bool)  # on the CPU, as the requests' tokens
        self.common[self._ids_cpu] = True
        rows = head_rows(model, self.ids).float()
        self.weight = quantize_weight(rows, scheme, group_size, head=True) if scheme in ("int8", "int4") else rows
        log.info("draft vocabulary: %d of %d tokens and each request's own", len(self.ids), config.vocab_size)

    def drafts(self, hidden: torch.Tensor, requests, uniforms: list[float | None]) -> list[int]:
        """Each row's draft over the common tokens and its request's own: its greedy token, or where
        ``uniforms[row]`` is a number, the token the target's sampler would draw with it from the
        draft's distribution (``draft_sampling``)."""
        out = [0] * len(requests)
        greedy = [row for row, u in enumerate(uniforms) if u is None]
        sampled = [row for row, u in enumerate(uniforms) if u is not None]
        if greedy:
            for row, token in zip(greedy, self.greedy(hidden[greedy], [requests[row] for row in greedy])):
                out[row] = token
        if sampled:
            ids, logits = self.scores(hidden[sampled], [requests[row] for row in sampled])
            picked = sample_drafts(self._sampler, logits, [requests[row].sampling_params for row in sampled],
                                   [uniforms[row] for row in sampled], self.vocab_size)
            for row, column in zip(sampled, picked):
                out[row] = column if ids is None else int(ids[column])
        return out

    def scores(self, hidden: torch.Tensor, requests) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The token ids the rows score -- the common ones and every row's own, in ascending order
        (``None``: all) -- and each row's logits at them, on the CPU: -inf at another row's own."""
        model = self.model
        if self.ids is None:
            return None, model.logits(hidden).float().cpu()
        normed = model.model.norm(hidden).float()
        common = self._common_scores(normed)
        owns = [self._own_rows(request) for request in requests]
        own_ids = torch.unique(torch.cat([own for own, _ in owns]))  # sorted
        # merged positions: each id after the other list's ids below it (the lists share none)
        common_at = torch.arange(len(self._ids_cpu)) + torch.searchsorted(own_ids, self._ids_cpu)
        own_at = torch.arange(len(own_ids)) + torch.searchsorted(self._ids_cpu, own_ids)
        ids = torch.empty(len(common_at) + len(own_ids), dtype=torch.long)
        ids[common_at], ids[own_at] = self._ids_cpu, own_ids
        logits = torch.full((len(requests), len(ids)), float("-inf"))
        logits[:, common_at] = common.float().cpu()
        for row, (own, rows) in enumerate(owns):
            if len(own):
                logits[row, own_at[torch.searchsorted(own_ids, own)]] = (rows @ normed[row]).float().cpu()
        if self.softcap:  # as the model's logits apply it (``DecoderModel.logits``); tanh(-inf) = -1
            logits = torch.where(torch.isinf(logits), logits, torch.tanh(logits / self.softcap) * self.softcap)
        return ids, logits

    def greedy(self, hidden: torch.Tensor, requests) -> list[int]:
        """Each row's greedy token over the common tokens and its request's own (``requests``: one per
        row, with ``request_id`` and ``all_token_ids``); every token where ``ids`` is None."""
        model = self.model
        if self.ids is None:
            tokens = model.screened_tokens(hidden, [0.0] * len(hidden))
            return (tokens if tokens is not None else model.logits(hidden).argmax(dim=-1)).tolist()
        normed = model.model.norm(hidden).float()
        tokens = self.ids[self._best_common(normed)]
        # the chosen tokens' scores, on the same footing as the request's own rows
        best = (normed * head_rows(model, tokens).float()).sum(dim=-1)
        out = tokens.tolist()
        for row, request in enumerate(requests):
            own, rows = self._own_rows(request)
            if len(own):
                scores = rows @ normed[row]
                top = int(scores.argmax())
                if scores[top] > best[row]:
                    out[row] = int(own[top])  # (own: on the CPU)
        return out

    def _best_common(self, normed: torch.Tensor) -> torch.Tensor:
        """Each row's index into ``ids`` of its largest score over the common tokens."""
        local = None if isinstance(self.weight, torch.Tensor) else self.weight.greedy_tokens(normed)
        return local if local is not None else self._common_scores(normed).argmax(dim=-1)

    def _common_scores(self, normed: torch.Tensor) -> torch.Tensor:
        """Each row's scores over the common tokens (``ids``' order)."""
        return normed @ self.weight.T if isinstance(self.weight, torch.Tensor) else self.weight.matmul(normed)

    def _own_rows(self, request) -> tuple[torch.Tensor, torch.Tensor]:
        """``request``'s token ids outside the common ones (at most ``_MAX_OWN_TOKENS``) and their head
        rows in fp32, updated with the tokens it gained since the last call."""
        seen, own, rows = self._own.get(request.request_id) or (0, torch.empty(0, dtype=torch.long), None)
        tokens = request.all_token_ids
        if len(tokens) > seen and len(own) < _MAX_OWN_TOKENS:
            new = torch.tensor(tokens[seen:], dtype=torch.long)
            new = new[(new >= 0) & (new < self.vocab_size)]
            new = torch.unique(new[~self.common[new]])
            new = new[~torch.isin(new, own)][:_MAX_OWN_TOKENS - len(own)]
            if len(new):
                new_rows = head_rows(self.model, new.to(self.device)).float()
                own = torch.cat([own, new])
                rows = new_rows if rows is None else torch.cat([rows, new_rows])
        self._own[request.request_id] = (len(tokens), own, rows)
        return own, rows

    def forget(self, request_id: str) -> None:
        self._own.pop(request_id, None)


def head_rows(model, ids: torch.Tensor) -> torch.Tensor | None:
    """Rows ``ids`` of ``model``'s LM head (its tied embedding's where it has no head of its own),
    dequantized; ``None`` where its only copy is in a layout they cannot be read from (oneDNN's)."""
    if model.cfg.tie_word_embeddings:
        if model.quantized_lm_head is not None:
            return model.quantized_lm_head.rows(ids)
        return model.model.embed_tokens.weight[ids]
    head = model.lm_head
    if head.quantized is not None:
        return head.quantized.rows(ids)
    if head.weight.numel():
        return head.weight[ids]
    panels = head.panels  # fp32: [outputs / LANES][inputs][LANES]
    if panels is not None and panels.dtype == torch.float32:
        return panels.panels.view(-1, panels.in_features, LANES)[ids // LANES, :, ids % LANES]
    return None
