"""What the gateway has sent each decode worker that the worker's heartbeat may not show yet,
and which worker computes a request's prompt along its route (the dispatcher's and the planner's
simulator's load accounting)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from common.cluster.registry import WorkerInfo
from gateway.routing import Route


@dataclass
class _Sent:
    blocks: int
    admitted_at: float | None = None  # wall clock of the first frame: the worker holds it since


def computed_on(route: Route, prompt_len: int) -> tuple[str, int]:
    """The worker that computes a request's prompt along ``route`` -- its prefill worker, or the
    decode worker itself -- and the prompt tokens it computes (what it does not cache)."""
    if route.prefill is not None:
        return route.prefill.worker_id, prompt_len - route.prefill_matched_tokens
    return route.decode.worker_id, prompt_len - route.decode_matched_tokens


def count_pending(pending: dict[str, int], worker_id: str, tokens: int) -> None:
    """Adds ``tokens`` (negative: takes them off) to a worker's pending prompt tokens; a worker
    left with none is dropped."""
    left = pending.get(worker_id, 0) + tokens
    if left > 0:
        pending[worker_id] = left
    else:
        pending.pop(worker_id, None)


class SentToDecode:
    """Requests this gateway sent to each decode worker that the worker's last heartbeat may not
    show yet: from the send until the first heartbeat stamped after the request's first frame (or
    until it ends).  A fresher load signal than the heartbeats, so a burst spreads.  ``clock``: the
    clock heartbeats are stamped with (wall time; the planner's simulator passes its own)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._by_worker: dict[str, dict[str, _Sent]] = {}
        self._clock = clock

    def add(self, worker_id: str, request_id: str, blocks: int) -> None:
        self._by_worker.setdefault(worker_id, {})[request_id] = _Sent(blocks)

    def admitted(self, worker_id: str, request_id: str) -> None:
        sent = self._by_worker.get(worker_id, {}).get(request_id)
        if sent is not None and sent.admitted_at is None:
            sent.admitted_at = self._clock()

    def remove(self, worker_id: str, request_id: str) -> None:
        sent = self._by_worker.get(worker_id)
        if sent is not None:
            sent.pop(request_id, None)
            if not sent:
                del self._by_worker[worker_id]

    def load(self, workers: Sequence[WorkerInfo]) -> dict[str, tuple[int, int]]:
        """``{worker_id: (requests, prompt blocks)}`` not in each worker's last heartbeat."""
        out = {}
        for w in workers:
            sent = self._by_worker.get(w.worker_id)
            if not sent:
                continue
            counted = [request_id for request_id, s in sent.items()
                       if s.admitted_at is not None and s.admitted_at < w.heartbeat_at]
            for request_id in counted:
                del sent[request_id]  # the heartbeat counts it now
            out[w.worker_id] = (len(sent), sum(s.blocks for s in sent.values()))
        return out
