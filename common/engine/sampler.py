"""Turn one step's logits into tokens, every row at once.

    logits [rows, vocab] (fp32, raw model output)
      |-- logit bias, min_tokens, grammar masks (logit_rules.py), in place
      |-- rows whose maximum is NaN/+inf/-inf: argmax over their finite values, never sampled
      |-- greedy rows (temperature < 1e-5, or top_k == 1): argmax (after penalties, if any)
      `-- random rows, copied into a scratch buffer ordered [filtered | plain | greedy+penalties]:
            penalties (repetition, frequency, presence: sparse, from each request's token ids)
            / temperature, - row max, exp          ->  e in (0, 1], the row's max is exactly 1
            plain rows: inverse CDF over column order, two levels (1024-column block sums, then
                        the chosen block's cumulative sum)
            top-p-only rows: the nucleus's threshold without a sort, then inverse CDF over its
                        tokens in column order (inverse_cdf.sample_wide_nucleus; on every device
                        and row width, so a draft model drawing with the row's number lands alike)
            other filtered rows (top-k, min-p, top-p beside them): candidates = e >= a per-row
                        threshold that provably holds every token the filters can keep; one sort
                        over the candidates of all rows; inverse CDF over the kept prefix

Every random row consumes exactly one uniform number.  A seeded row draws it from a generator
seeded with (seed, output index), so its token depends only on the seed, the position and its own
logits: not on the batch, preemption, or which worker samples it (the prefill worker samples the
first token, the decode worker the rest).  Unseeded rows share one batched draw.

Logprobs are those of the model's distribution after a grammar's mask, before the logit bias, the
min_tokens ban, penalties and temperature, as vLLM returns by default (common/engine/logit_rules.py):
one log-sum-exp and one top-k over the rows that ask.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Collection, Protocol, Sequence

import torch

from common.engine.inverse_cdf import block_sums, sample_plain, sample_wide_nucleus, uniforms_for
from common.engine.logit_rules import apply_logit_rules, needs_rules
from common.engine.penalty_histories import TokenHistories
from common.engine.row_argmax import row_max
from common.engine.sampling_params import SamplingParams
from common.engine.structured.backend import GrammarMatcher
from common.engine.structured.masking import TokenMasks

log = logging.getLogger(__name__)

GROUP = 64  # columns per group whose maxima bound the k-th largest value (top-k candidates)
# First candidate threshold for a top-k wider than the row's groups of columns allow to bound
# (relative to the row's most likely token); a row where fewer than k tokens reach it is redone
# with every token.
TOP_K_FIRST_THRESHOLD = 1e-4
_SMALLEST_POSITIVE = float(torch.finfo(torch.float32).smallest_normal) * 2.0**-23  # fp32's least subnormal


@dataclass
class TokenLogprobs:
    """The sampled token's log-probability and the ``n`` most likely alternatives; ``rank``: the
    token's place among all (1: the most likely), where it was computed (a scored prompt's)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


class SamplingRequest(Protocol):
    """What the sampler reads about one row (``ScheduledRequest`` provides it).

    ``prompt_token_ids`` and ``output_token_ids`` may be the request's live lists: the sampler
    only reads them, and only for rows with penalties.
    """

    request_id: str
    sampling_params: SamplingParams
    num_output_tokens: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    stop_token_ids: Collection[int]  # what ends it (held back until min_tokens)
    grammar: GrammarMatcher | None


@dataclass
class SamplingRow:
    """A ``SamplingRequest`` built by hand (tests, benchmarks, ``sample``)."""

    sampling_params: SamplingParams
    num_output_tokens: int = 0
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    request_id: str = ""
    stop_token_ids: Collection[int] = ()
    grammar: GrammarMatcher | None = None
    uniform: float | None = None  # the number it samples with (``inverse_cdf.uniforms_for``), if given


# ---- the sampler ----------------------------------------------------------------------------------


@dataclass
class _Rows:
    """Per-row knobs of the rows in the scratch buffer, as tensors (``n`` rows)."""

    temperature: torch.Tensor
    top_k: torch.Tensor  # 0: none (already clamped to the vocabulary)
    top_p: torch.Tensor
    min_p: torch.Tensor


@dataclass
class Sampler:
    """Samples one token per row of a step's logits with batched tensor ops (see the module doc).

    Holds a scratch buffer as large as the biggest batch of random rows seen (the size of those
    rows' logits) and the token histories of requests with penalties.  One thread uses it.
    ``num_fallbacks`` counts rows that fell back to their argmax because sampling them failed.
    """

    num_fallbacks: int = 0
    _scratch: torch.Tensor | None = None
    _mask: torch.Tensor | None = None
    _histories: TokenHistories = field(default_factory=TokenHistories)
    _masks: TokenMasks = field(default_factory=TokenMasks)

    def prefetch_masks(self, rows: Sequence[SamplingRequest], vocab: int) -> None:
        """Start filling the grammar masks of the rows about to be sampled (before the forward)."""
        matchers = [row.grammar for row in rows if row.grammar is not None]
        if matchers:
            self._masks.prefetch(matchers, vocab)

    @torch.inference_mode()  # the model's logits are inference tensors; so is the scratch buffer
    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRequest], *, scratch_logits: bool = False
                 ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """One token per row of ``logits`` [rows, vocab]; logprobs for rows that ask.

        ``scratch_logits``: the caller gives up ``logits``, which may then serve as the scratch
        buffer (saves a copy when no row wants logprobs).
        """
        for_logprobs = None
        if needs_rules(rows):  # logit bias, min_tokens, grammars (common/engine/logit_rules.py)
            logits = logits.float() if scratch_logits else logits.float().clone()
            logits = logits.contiguous()  # a view (the gathered logits of tensor parallelism) is copied
            for_logprobs = apply_logit_rules(logits, rows, self._masks)
        else:
            logits = logits.float()
        row_max, greedy = _row_max_and_argmax(logits, rows)
        bad = ~torch.isfinite(row_max)  # NaN, +inf, or nothing finite in the row
        greedy = _argmax_over_finite(logits, bad, greedy)
        try:
            tokens = self._sample(logits, rows, greedy, bad, row_max, scratch_logits)
        except Exception:  # a bug must not fail the other rows: retry row by row, then argmax
            log.exception("batched sampling failed; sampling the %d rows one by one", len(rows))
            tokens = greedy.clone()
            for i, row in enumerate(rows):
                try:
                    tokens[i] = self._sample(logits[i : i + 1], [row], greedy[i : i + 1], bad[i : i + 1],
                                             row_max[i : i + 1], False)[0]
                except Exception:
                    self.num_fallbacks += 1
                    log.exception("sampling row %d failed; using its argmax", i)
                    tokens[i] = _clean(logits[i : i + 1]).argmax(dim=-1)[0]
        token_ids = tokens.tolist()
        return token_ids, _logprobs(logits, rows, token_ids, bad, for_logprobs)

    def _sample(self, logits, rows, greedy, bad, raw_max, scratch_logits) -> torch.Tensor:
        num_rows, vocab = logits.shape
        bad_rows = bad.tolist()
        filtered, plain, penalized_argmax = [], [], []
        for i, row in enumerate(rows):
            p = row.sampling_params
            if bad_rows[i]:
                continue
            if p.takes_argmax:
                if p.uses_penalties:
                    penalized_argmax.append(i)
            elif (0 < p.top_k < vocab) or p.top_p < 1.0 or p.min_p > 0.0:
                filtered.append(i)
            else:
                plain.append(i)
        order = filtered + plain + penalized_argmax
        if not order:
            return greedy
        work = self._work_rows(logits, order, scratch_logits and not _wants_logprobs(rows))
        self._apply_penalties(work, [rows[i] for i in order], logits.device)
        tokens = greedy.clone()
        if penalized_argmax:
            start = len(filtered) + len(plain)
            tokens[penalized_argmax] = work[start:].argmax(dim=-1)
        random = filtered + plain
        if not random:
            return tokens
        knobs = _knobs([rows[i].sampling_params for i in random], vocab, logits.device)
        e = work[: len(random)]
        if any(rows[i].sampling_params.uses_penalties for i in random):
            row_max = e.amax(dim=-1, keepdim=True)
        else:
            row_max = raw_max[random][:, None]
        # exp((x - max) / T): the row's best token is exactly 1.  max(x / T) == max(x) / T, since
        # rounded division by a positive number keeps the order.
        e.sub_(row_max)
        if bool((knobs.temperature != 1.0).any()):
            e.div_(knobs.temperature[:, None])
        e.exp_()
        # A row whose numbers overflowed (a tiny temperature on huge logits) takes its argmax; it
        # is sampled as a harmless one-hot row meanwhile.
        broken = ~torch.isfinite(row_max[:, 0])
        if bool(broken.any()):
            e.masked_fill_(broken[:, None], 0.0)
            e[broken, 0] = 1.0
        totals = block_sums(e)
        total = totals.sum(dim=-1)
        uniforms = uniforms_for([rows[i] for i in random], logits.device)
        nf = len(filtered)
        sampled = torch.empty(len(random), dtype=torch.int64, device=logits.device)
        if filtered:
            sampled[:nf] = self._sample_filtered_rows(e[:nf], totals[:nf], total[:nf], _slice(knobs, nf),
                                                      uniforms[:nf])
        if plain:
            sampled[nf:] = sample_plain(e[nf:], totals[nf:], uniforms[nf:])
        if bool(broken.any()):
            self.num_fallbacks += int(broken.sum())
            broken_rows = [random[j] for j in broken.nonzero()[:, 0].tolist()]
            sampled[broken] = _clean(logits[broken_rows]).argmax(dim=-1)
        tokens[random] = sampled
        return tokens

    # ---- scratch and penalties ----------------------------------------------------------------

    def _work_rows(self, logits: torch.Tensor, order: list[int], in_place: bool) -> torch.Tensor:
        n, vocab = len(order), logits.shape[1]
        if in_place and order == list(range(logits.shape[0])) and logits.is_contiguous():
            return logits
        if self._scratch is None or self._scratch.shape[0] < n or self._scratch.shape[1] != vocab \
                or self._scratch.device != logits.device:
            rows = max(n, 0 if self._scratch is None else self._scratch.shape[0])
            self._scratch = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device)
            self._mask = None
        work = self._scratch[:n]
        torch.index_select(logits, 0, torch.tensor(order, device=logits.device), out=work)
        return work

    def _candidate_mask(self, e: torch.Tensor) -> torch.Tensor:
        if self._mask is None or self._mask.shape[0] < e.shape[0] or self._mask.shape[1] != e.shape[1] \
                or self._mask.device != e.device:
            self._mask = torch.empty(max(e.shape[0], 1 if self._mask is None else self._mask.shape[0]),
                                     e.shape[1], dtype=torch.bool, device=e.device)
        return self._mask[: e.shape[0]]

    def _apply_penalties(self, work: torch.Tensor, rows: list[SamplingRequest], device) -> None:
        """Repetition (prompt and output tokens), then frequency and presence (output tokens), as
        vLLM applies them; sparse updates at the rows' token ids, no [rows, vocab] structure."""
        with_penalties = [(j, row) for j, row in enumerate(rows) if row.sampling_params.uses_penalties]
        self._histories.keep_only({row.request_id for _, row in with_penalties})
        if not with_penalties:
            return
        vocab = work.shape[1]
        flat = work.view(-1)
        repeat_idx, repeat_by, count_idx, freq, pres = [], [], [], [], []
        for j, row in with_penalties:
            p = row.sampling_params
            history = self._histories.get(row, device)
            outputs = history.output_ids().clamp(0, vocab - 1) + j * vocab
            if p.repetition_penalty != 1.0:
                ids = torch.cat([history.prompt_unique.clamp(0, vocab - 1) + j * vocab, outputs])
                repeat_idx.append(ids)
                repeat_by.append(torch.full((ids.numel(),), p.repetition_penalty, dtype=torch.float32, device=device))
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                count_idx.append(outputs)
                freq.append(torch.full((outputs.numel(),), p.frequency_penalty, dtype=torch.float32, device=device))
                pres.append(torch.full((outputs.numel(),), p.presence_penalty, dtype=torch.float32, device=device))
        if repeat_idx:
            idx, by = torch.cat(repeat_idx), torch.cat(repeat_by)
            values = flat[idx]  # duplicates read and write the same value
            flat[idx] = torch.where(values > 0, values / by, values * by)
        if count_idx:
            idx = torch.cat(count_idx)
            flat.index_add_(0, idx, -torch.cat(freq))  # once per occurrence: frequency * count
            flat[idx] = flat[idx] - torch.cat(pres)  # once per distinct token: presence

    # ---- filtered rows: top-k, top-p, min-p ---------------------------------------------------

    def _sample_filtered_rows(self, e: torch.Tensor, block_sums: torch.Tensor, total: torch.Tensor, knobs: _Rows,
                              uniforms: torch.Tensor) -> torch.Tensor:
        """Top-p-only rows take ``sample_wide_nucleus`` (the nucleus without a sort, its tokens in
        column order; on CPU one C kernel pass, cheaper than the candidate sort on any row); every
        other filtered row the candidate sort.  One rule for top-p-only rows, whatever the device, the
        kernel's presence or the row's width: a draft model that draws a draft with the row's uniform
        number (``speculative.draft_sampling``, its logits on CPU) must land where the target does."""
        p_only = (knobs.top_p < 1.0) & (knobs.top_k == 0) & (knobs.min_p == 0.0)
        if not bool(p_only.any()):
            return self._sample_filtered(e, total, knobs, uniforms)
        if bool(p_only.all()):  # no copies of the rows
            return sample_wide_nucleus(e, knobs.top_p, uniforms)
        out = torch.empty(e.shape[0], dtype=torch.int64, device=e.device)
        w = p_only.nonzero()[:, 0]
        out[w] = sample_wide_nucleus(e[w], knobs.top_p[w], uniforms[w])
        rest = (~p_only).nonzero()[:, 0]
        knobs_rest = _Rows(knobs.temperature[rest], knobs.top_k[rest], knobs.top_p[rest], knobs.min_p[rest])
        out[rest] = self._sample_filtered(e[rest], total[rest], knobs_rest, uniforms[rest])
        return out

    def _sample_filtered(self, e: torch.Tensor, total: torch.Tensor, knobs: _Rows,
                         uniforms: torch.Tensor) -> torch.Tensor:
        """Inverse CDF over each row's kept tokens, in descending order (rows with top-k or min-p;
        a top-p beside them applies within what they keep).

        A per-row threshold picks the candidates: every token at or above it, chosen so the
        candidates provably hold whatever top-k/min-p keep:
          min-p:  its own threshold (min_p relative to the best token) is exact;
          top-k:  the k-th largest of the 64-column group maxima (at least k tokens reach it);
                  past the groups' count, first TOP_K_FIRST_THRESHOLD, then every token.
        Top-k keeps the tokens tied with its k-th too (as vLLM does).
        """
        n, vocab = e.shape
        device = e.device
        top_k, top_p, min_p = knobs.top_k, knobs.top_p, knobs.min_p
        has_k, has_min_p = top_k > 0, min_p > 0.0
        threshold = min_p.clone()
        # The candidates hold the whole (min-p filtered) distribution: its mass is known from them.
        complete = has_min_p.clone()
        groups = vocab // GROUP
        k_by_groups = has_k & (top_k <= groups)
        if bool(k_by_groups.any()):
            rows = k_by_groups.nonzero()[:, 0]
            maxima = e[:, : groups * GROUP].view(n, groups, GROUP).amax(dim=-1)[rows]
            kth = maxima.topk(int(top_k[rows].max()), dim=-1).values.gather(1, (top_k[rows] - 1)[:, None])[:, 0]
            threshold[rows] = torch.maximum(threshold[rows], kth)
        big_k = has_k & ~k_by_groups & ~has_min_p
        threshold = torch.where(big_k, torch.full_like(threshold, TOP_K_FIRST_THRESHOLD), threshold)
        threshold = torch.where(threshold > 0, threshold, torch.full_like(threshold, _SMALLEST_POSITIVE))

        row_ids, cols = self._candidates(e, threshold)
        values = e[row_ids, cols]
        counts = torch.bincount(row_ids, minlength=n)
        # Rows whose first threshold may have cut off tokens the top-k keeps: redo them with every token.
        short = big_k & (counts < top_k)
        if bool(short.any()):
            redo = short.nonzero()[:, 0]
            lower = torch.full((len(redo),), _SMALLEST_POSITIVE, device=device)
            complete = complete | short
            keep = ~short[row_ids]
            more_rows, more_cols = self._candidates(e[redo], lower)
            more_rows = redo[more_rows]
            row_ids = torch.cat([row_ids[keep], more_rows])
            cols = torch.cat([cols[keep], more_cols])
            values = torch.cat([values[keep], e[more_rows, more_cols]])
            order = torch.argsort(row_ids, stable=True)  # group by row, columns ascending within a row
            row_ids, cols, values = row_ids[order], cols[order], values[order]
            counts = torch.bincount(row_ids, minlength=n)

        # Candidates into a [rows, widest] table, then one sort over every row.
        width = int(counts.max())
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(len(row_ids), device=device) - starts[row_ids]
        table = torch.zeros(n, width, device=device)
        ids = torch.zeros(n, width, dtype=torch.int64, device=device)
        table[row_ids, slot] = values
        ids[row_ids, slot] = cols
        table, order = table.sort(dim=-1, descending=True, stable=True)  # ties keep column order
        ids = ids.gather(1, order)
        cumulative = table.double().cumsum(dim=-1)

        k = torch.where(has_k, torch.minimum(top_k, counts), counts).clamp(min=1)
        # top-k keeps every token as likely as its k-th (vLLM masks the logits below the k-th):
        # ties at the cut stay in (they are all candidates: each is at or above the threshold).
        kth = table.gather(1, (k - 1)[:, None])
        k = torch.where(has_k, (table >= kth).sum(dim=-1), k)
        # top_p is relative to what the earlier filters kept: the top-k set, the min-p survivors,
        # or (when the candidates are only a part of it) the whole distribution.
        kept_mass = cumulative.gather(1, (k - 1)[:, None])[:, 0]
        reference = torch.where(has_k | complete, kept_mass, total)
        before = cumulative - table.double()  # mass strictly before each position
        position = torch.arange(width, device=device)[None, :]
        kept = (position < k[:, None]) & (before < (top_p.double() * reference)[:, None])
        length = kept.sum(dim=-1).clamp(min=1)
        target = uniforms * cumulative.gather(1, (length - 1)[:, None])[:, 0]
        index = torch.searchsorted(cumulative, target[:, None], right=True)[:, 0]
        index = torch.minimum(index, length - 1)
        return ids.gather(1, index[:, None])[:, 0]

    def _candidates(self, e: torch.Tensor, threshold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = torch.ge(e, threshold[:, None], out=self._candidate_mask(e))
        found = mask.nonzero()
        return found[:, 0], found[:, 1]


def sample(logits: torch.Tensor, params: list[SamplingParams], output_index: list[int]
           ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """One-off sampling without histories: ``output_index[i]`` is row ``i``'s output position."""
    return Sampler()(logits, [SamplingRow(p, i) for p, i in zip(params, output_index)])


# ---- helpers ----------------------------------------------------------------------------------


# Sampled rows below this temperature keep the logits path: the screened head's rejection sampling
# accepts a trial with probability about exp(-bound / T), so its trials would run out.
SCREEN_MIN_TEMPERATURE = 0.25


def screen_inverse_temperatures(rows: Sequence[SamplingRequest]) -> list[float] | None:
    """Each row's 1 / temperature where the screened head can decide every row of the step without
    the logits (``DecoderModel.screened_tokens``): 0 for a row that takes the first maximal index
    of its raw logits (greedy or top-k 1), 1 / T for an unseeded row that samples softmax(logits / T)
    plainly; ``None`` where some row needs the logits -- penalties, logit rules, logprobs, top-k,
    top-p or min-p, a temperature below ``SCREEN_MIN_TEMPERATURE``, or a seed or a number drawn with
    its draft (such a row's token is the inverse CDF of that one uniform number, which the screen's
    rejection sampling would not reproduce).  A row whose logits are not all finite is the
    exception; the screen leaves such steps to ``Sampler``."""
    inverse = []
    for row in rows:
        p = row.sampling_params
        if p.uses_penalties or p.logprobs is not None or getattr(row, "uniform", None) is not None:
            return None
        if p.takes_argmax:
            inverse.append(0.0)
        elif (p.seed is None and p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0.0
              and p.temperature >= SCREEN_MIN_TEMPERATURE):
            inverse.append(1.0 / p.temperature)
        else:
            return None
    return None if needs_rules(rows) else inverse


def _wants_logprobs(rows: Sequence[SamplingRequest]) -> bool:
    return any(row.sampling_params.logprobs is not None for row in rows)


def _row_max_and_argmax(logits: torch.Tensor, rows: Sequence[SamplingRequest]
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's maximum and, when some row is greedy, each row's argmax: one pass over the
    logits (``max`` gives the first maximal index, as ``argmax`` does, and a NaN is its row's
    maximum for both; three times faster than ``amax`` then ``argmax`` over a 262k vocabulary;
    ``row_argmax``'s kernel for fp32 CPU rows, ~6x faster again)."""
    if any(row.sampling_params.takes_argmax for row in rows):
        return row_max(logits)
    return logits.amax(dim=-1), None


def _argmax_over_finite(logits: torch.Tensor, bad: torch.Tensor, argmax: torch.Tensor | None) -> torch.Tensor:
    """The argmax of each row: the greedy token, and the fallback of a row that cannot be sampled.
    A bad row (``bad``) gets the argmax over its finite values.  ``argmax``: every row's, where
    ``_row_max_and_argmax`` computed it (some row is greedy), else ``None`` (random rows get
    theirs when needed)."""
    tokens = argmax if argmax is not None else torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    if bool(bad.any()):
        tokens[bad] = _clean(logits[bad]).argmax(dim=-1)
    return tokens


def _clean(rows: torch.Tensor) -> torch.Tensor:
    return rows.masked_fill(~torch.isfinite(rows), float("-inf"))


def _knobs(params: list[SamplingParams], vocab: int, device) -> _Rows:
    return _Rows(
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
        top_k=torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params], dtype=torch.int64, device=device),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
    )


def _slice(knobs: _Rows, n: int) -> _Rows:
    return _Rows(knobs.temperature[:n], knobs.top_k[:n], knobs.top_p[:n], knobs.min_p[:n])


def _logprobs(logits: torch.Tensor, rows: Sequence[SamplingRequest], token_ids: list[int],
              bad: torch.Tensor, kept: torch.Tensor | None = None) -> list[TokenLogprobs | None]:
    """The logprobs of the rows that ask, read from ``logits`` -- or ``kept``, those rows' logits as
    the grammar left them (``apply_logit_rules``)."""
    out: list[TokenLogprobs | None] = [None] * len(rows)
    wanted = [i for i, row in enumerate(rows) if row.sampling_params.logprobs is not None]
    if not wanted:
        return out
    device = logits.device
    index = torch.tensor(wanted, device=device)
    values = logits.index_select(0, index) if kept is None else kept
    bad_wanted = bad[index]
    if bool(bad_wanted.any()):
        values[bad_wanted] = _clean(values[bad_wanted])
    normalizer = torch.logsumexp(values, dim=-1, keepdim=True)
    chosen = (values.gather(1, torch.tensor([token_ids[i] for i in wanted], device=device)[:, None])
              - normalizer)[:, 0].tolist()
    n = max(rows[i].sampling_params.logprobs for i in wanted)
    top_values, top_ids = values.topk(n, dim=-1) if n else (values[:, :0], values[:, :0].long())
    top_values = (top_values - normalizer).tolist()
    top_ids = top_ids.tolist()
    for j, i in enumerate(wanted):
        k = rows[i].sampling_params.logprobs
        out[i] = TokenLogprobs(token_ids[i], chosen[j], list(zip(top_ids[j][:k], top_values[j][:k])))
    return out
