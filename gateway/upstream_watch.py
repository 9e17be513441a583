"""Streams from decode workers that have left the registry: cut once they fall silent, so they move on.

A decode worker that is stopped (SIGSTOP, a debugger), hung or cut off from Redis stops heartbeating,
and its registry entry expires within the registry's TTL (seconds) -- but its open streams only
ended when the gateway's idle timeout ran out (60 s by default), though the gateway had seen the
worker go.  ``LeftWorkerWatch`` follows every stream the dispatcher reads (its worker, its response,
since when the dispatcher has waited for its next frames); after each read of the registry
(``WorkerPool.listeners``), a stream whose worker is no longer listed and that has kept the
dispatcher waiting ``silence_s`` or more is cut (its response closed): the dispatcher's read of it
fails as a lost worker's does, and the stream moves to another worker (``gateway.migration``) or,
before its first token, is retried elsewhere.  A worker that only lost Redis but still streams is
left alone while its frames keep coming, and so is one whose frames wait for a slow client.
"""
from __future__ import annotations

import logging
import time
from typing import Sequence

import aiohttp

from common.cluster.registry import WorkerInfo

log = logging.getLogger(__name__)

SILENCE_S = 2.0  # a stream of a worker gone from the registry is cut once silent this long


class WatchedStream:
    """One stream being read: its decode worker, its response, since when the dispatcher has been
    waiting for its next frames (``None``: it is not -- it passes frames on, perhaps to a slow
    client, while the worker's go on arriving), whether cut."""

    __slots__ = ("worker_id", "response", "waiting_since", "cut")

    def __init__(self, worker_id: str, response: aiohttp.ClientResponse):
        self.worker_id, self.response = worker_id, response
        self.waiting_since: float | None = None
        self.cut = False

    def waiting(self) -> None:
        """The dispatcher waits for the stream's next frames from now."""
        self.waiting_since = time.monotonic()

    def heard(self) -> None:
        self.waiting_since = None

    def silent_for(self, now: float) -> float:
        return 0.0 if self.waiting_since is None else now - self.waiting_since


class LeftWorkerWatch:
    """The streams the dispatcher reads now; ``pool_changed`` is a ``WorkerPool`` listener."""

    def __init__(self, silence_s: float = SILENCE_S):
        self.silence_s = silence_s
        self._streams: set[WatchedStream] = set()

    def __len__(self) -> int:
        """Streams being read now."""
        return len(self._streams)

    def watch(self, worker_id: str, response: aiohttp.ClientResponse) -> WatchedStream:
        stream = WatchedStream(worker_id, response)
        self._streams.add(stream)
        return stream

    def forget(self, stream: WatchedStream | None) -> None:
        self._streams.discard(stream)

    def pool_changed(self, previous: Sequence[WorkerInfo], current: Sequence[WorkerInfo]) -> None:
        if not self._streams:
            return
        listed = {w.worker_id for w in current}
        now = time.monotonic()
        for stream in list(self._streams):
            if stream.worker_id not in listed and not stream.cut and stream.silent_for(now) >= self.silence_s:
                stream.cut = True
                log.warning("decode worker %s left the registry and its stream has been silent %.1f s: cut, to "
                            "move on", stream.worker_id, stream.silent_for(now))
                stream.response.close()
