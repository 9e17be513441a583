"""Runs one packed forward per step over every scheduled token, then samples."""
from __future__ import annotations

import time
from typing import Callable

import torch

from common.engine.attention.interface import AttentionRequest, OutputRows, trailing_queries
from common.engine.kv.kv_cache import KVCache
from common.engine.models.decoder import DecoderModel
from common.engine.parallel.step_broadcast import StepBroadcast
from common.engine.parallel.tensor_parallel import TensorParallel
from common.engine.prompt_logprobs import score
from common.engine.sampler import Sampler, TokenLogprobs, screen_inverse_temperatures
from common.engine.scheduler_output import SchedulerOutput
from common.engine.speculative.verify import kept_tokens, num_rows, sampling_rows


class ModelRunner:
    """Turns a ``SchedulerOutput`` into model inputs, runs the model and samples.

    Only the last token of a request that finishes its scheduled tokens this step is projected
    to logits (and its draft tokens', when it speculates: ``speculative.verify``); prompt chunks
    that end mid-prompt produce no logits at all (but the rows of a request that scores its prompt:
    ``prompt_logprobs``, in ``self.prompt_logprobs`` after the step).  Where fewer rows sample than the step has
    tokens, the model's last layer goes on past its K/V for the sampling rows alone
    (``OutputRows``): a prompt's other tokens need only their keys and values there.

    ``on_kv_written``: callables run on every step right after its forward is enqueued, before
    sampling, with the step's ``SchedulerOutput``. On CUDA the step's KV writes are then queued
    on the current stream but not necessarily done (a step without sampling returns without a
    sync): whoever reads those blocks outside this stream (KV shipping) records a CUDA event
    here and waits on it first.

    ``graphs``: a ``CudaGraphs`` that runs decode-only steps when it can (``None``: eager).
    ``tp``: with tensor parallelism every rank runs the forward, rank 0 samples and broadcasts.
    """

    def __init__(self, model: DecoderModel, cache: KVCache, attention, device: torch.device, graphs=None,
                 tp: TensorParallel | None = None):
        self.model = model
        self.cache = cache
        self.attention = attention
        self.device = device
        self.graphs = graphs
        self.tp = tp or TensorParallel()
        # Rank 0 of a tensor-parallel group sends each step to the other ranks before computing it.
        self.steps = StepBroadcast(self.tp) if self.tp.size > 1 else None
        self.followers_out_of_step = False
        self.sampler = Sampler()
        self.forward_seconds = 0.0  # time inside the model, for the overhead figure
        self.on_kv_written: list[Callable[[SchedulerOutput], None]] = []
        # The last step's prompt logprobs, request id -> entries (``common.engine.prompt_logprobs``).
        self.prompt_logprobs: dict[str, list[TokenLogprobs]] = {}

    def execute(self, out: SchedulerOutput) -> dict[str, tuple[list[int], list[TokenLogprobs | None]]]:
        """Compute the step; returns ``request_id -> (tokens, their logprobs)`` for the requests that
        sample: one token, or the drafts the model agreed with and one of its own.  On rank 0 of a
        tensor-parallel group, a failure once the step is being sent to the other ranks leaves them
        waiting in its collectives: ``followers_out_of_step`` says so from then on."""
        self.prompt_logprobs = {}
        if self.steps is None or self.tp.rank > 0:
            return self._compute(out)
        self.followers_out_of_step = True  # from the step's send (a collective too) until it is whole
        self.steps.send(out)
        sampled = self._compute(out)
        self.followers_out_of_step = False
        return sampled

    def _compute(self, out: SchedulerOutput) -> dict[str, tuple[list[int], list[TokenLogprobs | None]]]:
        input_ids: list[int] = []
        positions: list[int] = []
        attn_requests: list[AttentionRequest] = []
        sample_rows: list[int] = []
        sample_items = []
        rows_per_request: list[int] = []
        output_rows: list[int] = []  # the rows whose final hidden states the step needs
        scoring: list[tuple] = []  # (item, its first row in the batch, its scored rows' first and end)
        for item in out.scheduled:
            start = len(input_ids)
            n = len(item.token_ids)
            input_ids.extend(item.token_ids)
            positions.extend(range(item.num_computed_tokens, item.num_computed_tokens + n))
            attn_requests.append(AttentionRequest(start, n, item.num_computed_tokens + n, item.block_ids,
                                                  item.table_row))
            count = num_rows(item) if item.sample else 0
            if item.sample:
                sample_rows.extend(range(start + n - count, start + n))
                sample_items.append(item)
            begin, end = item.prompt_logprob_rows
            if begin < end:  # the rows from the first scored one to the slice's end go on (OutputRows)
                scoring.append((item, start, begin, end))
                count = max(count, n - begin)
            rows_per_request.append(count)
            output_rows.extend(range(start + n - count, start + n))
        device = self.device
        rows = sampling_rows(sample_items)
        if rows and self.tp.rank == 0:  # grammar masks fill in a thread while the model runs
            self.sampler.prefetch_masks(rows, self.model.cfg.vocab_size)
        began = time.perf_counter()
        hidden = self.graphs.run(input_ids, positions, attn_requests) if self.graphs is not None else None
        output = None
        if hidden is None:
            meta = self.attention.prepare(attn_requests, device)
            output = self._output_rows(attn_requests, rows_per_request, output_rows, len(input_ids))
            began = time.perf_counter()
            hidden = self.model(
                torch.tensor(input_ids, device=device),
                torch.tensor(positions, device=device),
                self.cache,
                meta,
                self.attention,
                output,
            )
        for hook in self.on_kv_written:
            hook(out)
        self.prompt_logprobs = self._score_prompts(hidden, output, output_rows, scoring) if scoring else {}
        if not sample_items:
            self.forward_seconds += time.perf_counter() - began
            return {}
        sampled_hidden = hidden if output is not None and not scoring else \
            _take(hidden, output, output_rows, sample_rows)
        inverse_temperatures = screen_inverse_temperatures(rows)
        screened = (self.model.screened_tokens(sampled_hidden, inverse_temperatures)
                    if inverse_temperatures is not None else None)
        if screened is not None:  # the rows' tokens without the logits (models/greedy_head.py)
            tokens, logprobs = screened.tolist(), [None] * len(rows)
            undecided = [i for i, token in enumerate(tokens) if token < 0]
            if undecided:  # sampled rows no trial decided: these alone from their logits
                drawn, _ = self.sampler(self.model.logits(sampled_hidden[undecided]),
                                        [rows[i] for i in undecided], scratch_logits=True)
                for i, token in zip(undecided, drawn):
                    tokens[i] = token
        elif self.tp.rank == 0:
            tokens, logprobs = self.sampler(self.model.logits(sampled_hidden), rows, scratch_logits=True)
        else:  # tensor parallelism: rank 0 samples, the other ranks take its tokens
            self.model.logits(sampled_hidden)
            tokens, logprobs = None, [None] * len(rows)
        tokens = self.tp.broadcast_tokens(tokens, len(rows))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.forward_seconds += time.perf_counter() - began
        return kept_tokens(sample_items, tokens, logprobs)

    def _score_prompts(self, hidden: torch.Tensor, output: OutputRows | None, output_rows: list[int],
                       scoring: list[tuple]) -> dict[str, list[TokenLogprobs]]:
        """The prompt tokens this step scores (``common.engine.prompt_logprobs``), per request; on
        tensor-parallel ranks other than 0, only their share of the projections (an empty dict)."""
        rows = [start + row for _item, start, begin, end in scoring for row in range(begin, end)]
        rank0 = self.tp.rank == 0
        # Position p = num_computed_tokens + offset scores prompt token p + 1.
        targets = [item.prompt_token_ids[item.num_computed_tokens + offset + 1]
                   for item, _start, begin, end in scoring for offset in range(begin, end)] if rank0 else None
        top = max(item.sampling_params.prompt_logprobs or 0 for item, *_ in scoring)
        entries = score(self.model.logits, _take(hidden, output, output_rows, rows), targets, top)
        if not rank0:
            return {}
        scored, at = {}, 0
        for item, _start, begin, end in scoring:
            k = item.sampling_params.prompt_logprobs
            scored[item.request_id] = [TokenLogprobs(e.token_id, e.logprob, e.top[:k], e.rank)
                                       for e in entries[at:at + end - begin]]
            at += end - begin
        return scored

    def _output_rows(self, attn_requests: list[AttentionRequest], rows_per_request: list[int], output_rows: list[int],
                     num_tokens: int) -> OutputRows | None:
        """The rows the step needs (sampling, scoring the prompt) as the model's ``OutputRows``;
        ``None`` where it needs every token's."""
        if len(output_rows) == num_tokens:
            return None
        rows = torch.tensor(output_rows, dtype=torch.long, device=self.device)
        trailing = trailing_queries(attn_requests, rows_per_request)
        return OutputRows(rows, self.attention.prepare(trailing, self.device) if trailing else None)


def _take(hidden: torch.Tensor, output: OutputRows | None, output_rows: list[int], rows: list[int]) -> torch.Tensor:
    """The final hidden states of the batch's ``rows``: ``hidden`` holds every token's where
    ``output`` is None, else those of ``output_rows`` alone, in order."""
    if output is not None:
        where = {row: i for i, row in enumerate(output_rows)}
        rows = [where[row] for row in rows]
    return hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)]
