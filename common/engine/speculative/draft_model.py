"""A draft model as the proposer: a smaller model of the same vocabulary guesses the next tokens --
greedily, or for a sampled request by sampling its own distribution with the uniform numbers the
target's rows will use (``draft_sampling``) -- on the decode worker, beside the target model.

Its KV lives in a cache of its own shape at the target's block ids: a request's block table holds
the slots of both, so the draft needs no allocation of its own and its KV is freed with the
request's blocks.  The draft computes what it lacks itself: a request's prompt (in PD serving the
target's prompt KV came from the prefill worker; the draft's never leaves the decode worker), then
the tokens accepted since it last ran, then one token per draft::

    all tokens   [ prompt ...... | out ... last ]   draft KV valid below ``computed``
    one proposal:  feed [computed .. last] -> d1, feed [d1] -> d2, ... -> dk   (k forwards)

The slots it writes (up to the one before the last draft) are among those the scheduler allocated
for the verification.  After it, the draft's KV stays valid up to the last accepted draft it fed;
a preempted request (its blocks freed) starts again from nothing.  Verification stays exact
whatever the drafts (``verify``, ``draft_sampling``).  Blocks shared through the
prefix cache are written with the same values by every request that computes them.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from common.engine.attention.interface import AttentionRequest
from common.engine.attention.selection import make_attention
from common.engine.kv.kv_cache import KVCache, KVLayout, dtype_name
from common.engine.loading.checkpoint_path import resolve_checkpoint
from common.engine.loading.model_loader import load_model
from common.engine.models.quantization_scheme import NO_QUANTIZATION, Quantization
from common.engine.speculative.draft_vocabulary import DraftHead

log = logging.getLogger(__name__)

_TIMED_FEED = 16  # tokens a first forward feeds at least for its time to count as catching up
_FEED_WEIGHT = 0.3  # of the newest such forward in ``seconds_per_fed_token``


class DraftModelProposer:
    """Drafts from ``checkpoint`` (see the module docstring)."""

    needs_slots_first = True  # its forwards write KV at the slots the verification will use
    # Whether the last proposal fed some request more than a verification's worth of tokens: its
    # prompt, or what it produced while it did not speculate.  That catch-up is a request's entry
    # into speculation, which ``Speculation`` weighs by itself, not what verifying costs from step to
    # step (``Speculation.observe_step``).
    catching_up = False
    # Seconds the draft takes per token it catches up on (a moving average over forwards of at least
    # _TIMED_FEED tokens): what a request's entry into speculation costs (``Speculation``).
    seconds_per_fed_token: float | None = None

    def __init__(self, checkpoint: str, quantization: Quantization = NO_QUANTIZATION, *, vocab_size: int,
                 num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device, attention_backend: str,
                 block_table=None, draft_vocab_size: int = 0):
        """``draft_vocab_size``: the common tokens its head scores beside each request's own
        (``draft_vocabulary``; 0: every token)."""
        self.checkpoint = resolve_checkpoint(checkpoint)
        self.model, self.config = load_model(self.checkpoint, dtype, device, quantization=quantization)
        if self.config.vocab_size != vocab_size:
            raise ValueError(f"the draft model {checkpoint!r} has a vocabulary of {self.config.vocab_size} tokens but the "
                             f"model it drafts for has {vocab_size}: a draft model must share the tokenizer")
        cfg = self.config
        layout = KVLayout(model_id=f"draft:{Path(self.checkpoint).name}", dtype=dtype_name(dtype), block_size=block_size,
                          num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
        self.cache = KVCache(layout, num_blocks, device)
        self.attention = make_attention(attention_backend, device, {cfg.window(i) for i in range(cfg.num_layers)},
                                        block_size, dtype)
        if hasattr(self.attention, "block_table"):
            self.attention.block_table = block_table
        self.device = device
        self.head = DraftHead(self.model, cfg, self.checkpoint, draft_vocab_size, quantization.scheme,
                              quantization.group_size, device)
        self._computed: dict[str, int] = {}  # request -> its tokens with draft KV
        log.info("draft model %s: %d layers, weights %s, its KV cache %.1f MiB", self.checkpoint.name, cfg.num_layers,
                 quantization.scheme, num_blocks * self.cache.block_nbytes / 2**20)

    def propose(self, request, num_tokens: int, block_ids: list[int]) -> list[int]:
        """Up to ``num_tokens`` greedy drafts after ``request``'s tokens, writing the draft's KV
        at ``block_ids`` (which hold every position up to the last draft); ``propose_batch`` also
        samples."""
        return self.propose_batch([(request, num_tokens, block_ids, None)])[0] if num_tokens > 0 else []

    @torch.inference_mode()
    def propose_batch(self, wants: list[tuple]) -> list[list[int]]:
        """``propose`` for a step's requests at once, ``wants``: (request, number of drafts, block
        ids, the uniform number of each draft's row or None) each -- with the numbers, the drafts
        are samples of the draft's distribution that the rows will keep where the target's sample
        agrees (``draft_sampling``), else greedy.  One forward per draft position over every request
        that still wants one: the first feeds each request what its draft KV lacks, the next ones a
        draft each."""
        drafts: list[list[int]] = [[] for _ in wants]
        positions = [self._computed.get(request.request_id, 0) for request, *_ in wants]
        feeds = [request.all_token_ids[position:] for (request, *_), position in zip(wants, positions)]
        self.catching_up = any(wanted > 0 and len(feed) > 1 + wanted for (_, wanted, *_), feed in zip(wants, feeds))
        for step in range(max((wanted for _, wanted, *_ in wants), default=0)):
            live = [i for i, (_, wanted, *_) in enumerate(wants) if wanted > step]
            tokens: list[int] = []
            token_positions: list[int] = []
            slices: list[AttentionRequest] = []
            last: list[int] = []  # each request's last token in the packed batch
            for i in live:
                feed, position = feeds[i], positions[i]
                slices.append(AttentionRequest(len(tokens), len(feed), position + len(feed), wants[i][2]))
                tokens.extend(feed)
                token_positions.extend(range(position, position + len(feed)))
                last.append(len(tokens) - 1)
            began = time.perf_counter()
            meta = self.attention.prepare(slices, self.device)
            hidden = self.model(torch.tensor(tokens, device=self.device),
                                torch.tensor(token_positions, device=self.device), self.cache, meta, self.attention)
            picked = self.head.drafts(hidden[last], [wants[i][0] for i in live],
                                      [wants[i][3][step] if wants[i][3] else None for i in live])
            if step == 0 and len(tokens) >= _TIMED_FEED:
                self._time_feed((time.perf_counter() - began) / len(tokens))
            for i, token in zip(live, picked):
                drafts[i].append(token)
                positions[i] += len(feeds[i])
                feeds[i] = [token]
        for (request, wanted, *_), position in zip(wants, positions):
            if wanted > 0:
                self._computed[request.request_id] = position  # through d(k-1); dk was never fed
        return drafts

    def _time_feed(self, seconds_per_token: float) -> None:
        last = self.seconds_per_fed_token
        if last is not None:
            seconds_per_token = last + _FEED_WEIGHT * (seconds_per_token - last)
        self.seconds_per_fed_token = seconds_per_token

    def entry_tokens(self, request) -> int:
        """Tokens of ``request`` the draft would feed before its first draft: its prompt and
        outputs past what the draft computed."""
        return request.num_tokens - self._computed.get(request.request_id, 0)

    def accepted(self, request_id: str, num_tokens_before: int, num_drafts: int, num_accepted: int) -> None:
        """A verification kept ``num_accepted`` of ``num_drafts``: the draft's KV stays valid for the
        last token before it and the accepted drafts it fed."""
        if request_id in self._computed:
            valid = num_tokens_before + min(num_accepted, num_drafts - 1)
            self._computed[request_id] = min(self._computed[request_id], valid)

    def forget(self, request_id: str) -> None:
        self._computed.pop(request_id, None)
        self.head.forget(request_id)
