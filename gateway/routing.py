"""Choosing the workers for one request: a decode worker by load, a prefill worker by policy.

Pure functions of plain data (``WorkerInfo`` lists from the registry, prefix matches from the
prefix index), so every decision is reproducible in a unit test.  Only ``state == "active"``
workers are candidates; ``role == "both"`` workers are candidates for either side.

Policies for the prefill worker:

- ``round_robin``: rotate over the candidates in worker_id order.
- ``least_load``: fewest queued prefill tokens (then fewest requests, lowest KV usage).
- ``prefix_aware``: trade cached prefix against queue, with a cap on imbalance::

      q(w)       = prompt tokens queued on w, not yet computed: the larger of what w reported
                   (load.num_waiting_prefill_tokens, as of its last heartbeat) and what this
                   gateway has sent w to compute -- to prefill, or as a colocated worker
                   computing the prompt itself -- that has not produced its first token yet
                   (``pending``)
      m(w)       = tokens of this prompt w already caches              (leading blocks * block_size)
      eligible   = { w : q(w) <= min_v q(v) + max_imbalance_tokens }
      score(w)   = m(w) - alpha * q(w)
      choose       argmax score over eligible; ties -> smaller q, then rendezvous hash of
                   (the prompt's first block, w), so a prefix nobody caches yet lands on the
                   same worker every time and different prefixes spread over the pool

  With ``alpha = 1`` the score is ``-(q(w) + prompt_len - m(w))`` plus a constant: the prefill work
  queued ahead of this prompt plus the prompt's own uncached work, i.e. a TTFT estimate in tokens.
  ``alpha > 1`` weights queues more (spreads load); ``alpha < 1`` chases cache hits harder.  The
  imbalance cap keeps a worker that holds a popular prefix from being buried: once its queue is
  ``max_imbalance_tokens`` longer than the shortest, it is skipped however good its match.

The decode worker is the one with the lowest ``decode_load = max(kv_usage + b / num_kv_blocks,
(running + waiting + r) / max_num_seqs)``: memory or batch slots, whichever is scarcer, where ``r``
requests holding ``b`` prompt blocks are what this gateway sent the worker that its last heartbeat
does not show yet (``pending_decode``), so a burst spreads instead of piling onto the worker that
was least loaded at its last heartbeat (``round_robin`` rotates instead).

Skipping the prefill pool: the decode worker computes the prompt itself when its uncached part
``prompt_len - m(decode)`` is below ``skip_prefill_below_tokens`` (that covers short prompts, since
``m <= prompt_len``), when no prefill worker is active, or when the chosen prefill worker is the
decode worker itself (a ``both`` worker).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import xxhash

from common.cluster.registry import WorkerInfo

POLICIES = ("round_robin", "least_load", "prefix_aware")


class NoWorkerAvailable(RuntimeError):
    """No active worker can take the request (the gateway answers 503 with Retry-After)."""


@dataclass(frozen=True)
class RoutingConfig:
    """Routing knobs (see the module docstring for what each one does)."""

    policy: str = "prefix_aware"
    alpha: float = 1.0
    max_imbalance_tokens: int = 8192
    skip_prefill_below_tokens: int = 64

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy {self.policy!r}: expected one of {list(POLICIES)}")
        if not self.alpha >= 0:
            raise ValueError(f"routing alpha must be >= 0, got {self.alpha}")
        if self.max_imbalance_tokens < 0:
            raise ValueError(f"max_imbalance_tokens must be >= 0, got {self.max_imbalance_tokens}")
        if self.skip_prefill_below_tokens < 0:
            raise ValueError(f"skip_prefill_below_tokens must be >= 0, got {self.skip_prefill_below_tokens}")


@dataclass(frozen=True)
class Route:
    """Where one request goes.  ``prefill is None``: the decode worker computes the prompt."""

    decode: WorkerInfo
    prefill: WorkerInfo | None
    decode_matched_tokens: int
    prefill_matched_tokens: int
    reason: str


def prefill_load(w: WorkerInfo, pending: Mapping[str, int] | None = None) -> int:
    return max(w.load.num_waiting_prefill_tokens, (pending or {}).get(w.worker_id, 0))


def rendezvous(key: bytes, worker_id: str) -> int:
    """Highest-random-weight hashing: a stable, well-spread preference of ``key`` for a worker."""
    return xxhash.xxh3_64_intdigest(key + worker_id.encode())


def decode_load(w: WorkerInfo, pending: tuple[int, int] = (0, 0)) -> float:
    """``pending``: (requests, prompt blocks) sent to ``w`` that its last heartbeat does not show."""
    requests, blocks = pending
    return max(w.load.kv_usage + blocks / w.capacity.num_kv_blocks,
               (w.load.num_running + w.load.num_waiting + requests) / w.capacity.max_num_seqs)


def matched_tokens(w: WorkerInfo, matched_blocks: Mapping[str, int], prompt_len: int) -> int:
    """Tokens of the prompt ``w`` caches, from its count of leading cached blocks."""
    return min(prompt_len, matched_blocks.get(w.worker_id, 0) * w.capacity.block_size)


class Router:
    """Applies a ``RoutingConfig``.  Holds only the round-robin cursors."""

    def __init__(self, config: RoutingConfig = RoutingConfig()) -> None:
        self.config = config
        self._rr = {"prefill": 0, "decode": 0}

    def route(
        self, workers: Sequence[WorkerInfo], prompt_len: int, matched_blocks: Mapping[str, int] | None = None,
        *, affinity_key: bytes = b"", pending: Mapping[str, int] | None = None,
        pending_decode: Mapping[str, tuple[int, int]] | None = None,
    ) -> Route:
        """Choose the decode worker, then decide whether and where to prefill.

        ``matched_blocks`` is ``PrefixIndexReader.longest_prefix`` output (``{}`` when Redis is
        down, which makes ``prefix_aware`` behave like ``least_load``).  ``affinity_key`` (the
        prompt's first block hash) breaks ties; ``pending`` is this gateway's own count of prompt
        tokens sent to each worker to compute (prefill, or a decode worker's own) and not started
        yet (fresher than heartbeats);
        ``pending_decode`` its count of (requests, prompt blocks) sent to each decode worker that
        the worker's last heartbeat does not show yet.
        Raises ``NoWorkerAvailable`` when no active worker can decode.
        """
        if prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
        matched_blocks = matched_blocks or {}
        active = [w for w in workers if w.state == "active"]
        decoders = [w for w in active if w.role in ("decode", "both")]
        prefillers = [w for w in active if w.role in ("prefill", "both")]
        if not decoders:
            raise NoWorkerAvailable("no active decode worker")

        decode = self.choose_decode(decoders, pending_decode)
        d_matched = matched_tokens(decode, matched_blocks, prompt_len)

        def direct(reason: str) -> Route:
            return Route(decode, None, d_matched, d_matched, reason)

        threshold = self.config.skip_prefill_below_tokens
        if prompt_len - d_matched < threshold:
            why = "short prompt" if prompt_len < threshold else "decode worker caches most of the prompt"
            return direct(why)
        if not prefillers:
            return direct("no active prefill worker")
        prefill = self.choose_prefill(prefillers, prompt_len, matched_blocks, affinity_key, pending)
        if prefill.worker_id == decode.worker_id:
            return direct("prefill worker is the decode worker")
        p_matched = matched_tokens(prefill, matched_blocks, prompt_len)
        return Route(decode, prefill, d_matched, p_matched, self.config.policy)

    def choose_decode(self, candidates: Sequence[WorkerInfo],
                      pending: Mapping[str, tuple[int, int]] | None = None) -> WorkerInfo:
        if not candidates:
            raise NoWorkerAvailable("no active decode worker")
        if self.config.policy == "round_robin":
            return self._next("decode", candidates)
        pending = pending or {}
        return min(candidates, key=lambda w: (decode_load(w, pending.get(w.worker_id, (0, 0))), w.load.kv_usage,
                                              w.worker_id))

    def choose_prefill(
        self, candidates: Sequence[WorkerInfo], prompt_len: int, matched_blocks: Mapping[str, int],
        affinity_key: bytes = b"", pending: Mapping[str, int] | None = None,
    ) -> WorkerInfo:
        if not candidates:
            raise NoWorkerAvailable("no active prefill worker")
        policy = self.config.policy
        if policy == "round_robin":
            return self._next("prefill", candidates)
        load = {w.worker_id: prefill_load(w, pending) for w in candidates}
        if policy == "least_load":
            return min(candidates, key=lambda w: (load[w.worker_id], w.load.num_waiting + w.load.num_running,
                                                  w.load.kv_usage, w.worker_id))
        q_min = min(load.values())
        eligible = [w for w in candidates if load[w.worker_id] <= q_min + self.config.max_imbalance_tokens]
        alpha = self.config.alpha

        def rank(w: WorkerInfo) -> tuple[float, int, int]:
            q = load[w.worker_id]
            score = matched_tokens(w, matched_blocks, prompt_len) - alpha * q
            return (-score, q, -rendezvous(affinity_key, w.worker_id))

        return min(eligible, key=rank)

    def _next(self, side: str, candidates: Sequence[WorkerInfo]) -> WorkerInfo:
        ordered = sorted(candidates, key=lambda w: w.worker_id)
        chosen = ordered[self._rr[side] % len(ordered)]
        self._rr[side] += 1
        return chosen
