"""Moving a live stream to another decode worker: replay.

When the decode worker of a stream that has started dies, stops answering, or drains and hands
the stream over (a "migrate" frame at a token boundary), the gateway -- which holds every token it
passed on -- sends the prompt and those tokens (``GenerateRequest.resume_token_ids``) to another
decode worker.  That worker computes their KV itself and continues as the first would have: the
tokens count toward ``max_tokens`` and the penalties, a seeded request draws at the next output
index, a grammar has advanced through them (``common.engine.request.resume_request``), and the
stop-string window lives here in the gateway's decoder.  The client sees one stream, without a
break, a duplicate or a lost token.

A stream handed over by a draining worker moves live: that worker's cache still holds the
stream's KV, so the new worker fetches it from there over ``kvtransfer`` (the draining worker
serves it as a prefill worker would: ``prefill_svc.prefill``) instead of computing it, and computes
it only if that fails.  A lost worker's streams are computed again where they continue.

Before it hands a stream over, the draining worker says it will (a ``move_soon`` frame), and keeps
decoding it.  The gateway then pre-copies: it picks the worker the stream will move to and asks it
for the stream's KV so far (a request for the prompt and the tokens sent so far, fetched from the
draining worker, that ends at the fetched token: ``GenerateRequest.precopy_of``), which leaves
those blocks in that worker's prefix cache.  The hand-over follows once the pre-copy has ended; the
stream moves to that worker, which holds all but the last few tokens' KV and fetches only those.

Where no active decode worker can take a moved stream (the worker a drain handed it to died), a
draining or drained one continues it -- the one it left first -- and decodes it to its end: the
stream is not movable there (its registry may still list the dead worker as active, and a drain
would hand the stream straight back to nobody; ``StreamMigration.last_resort``).

At most ``limit`` moves per request (``--migration-limit``; 0 turns it off: a lost worker ends
the stream with an error, a draining worker decodes its streams to the end).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from common.cluster.messages import TokenFrame
from common.cluster.registry import WorkerInfo
from gateway.metrics import GatewayMetrics
from gateway.routing import Route

log = logging.getLogger(__name__)


@dataclass
class StreamMigration:
    """One request's moves: the tokens its client has, and how many moves are left."""

    limit: int
    metrics: GatewayMetrics
    sent: list[int] = field(default_factory=list)  # output tokens passed on to the client
    moves: int = 0
    kv_source: WorkerInfo | None = None  # the draining worker the stream left, which holds its KV
    drained_from: list[str] = field(default_factory=list)  # workers whose drain handed the stream over
    moved_at: float | None = None  # when it last moved, until its next token
    move_cause: str = ""  # why it last moved (counted once another worker continues it)
    precopied_to: WorkerInfo | None = None  # the worker its KV was pre-copied to, until it moves
    precopy: asyncio.Task | None = None  # the pre-copy in flight

    def passed_on(self, frames: list[TokenFrame]) -> None:
        """``frames`` go to the client now."""
        for frame in frames:
            self.sent.extend(frame.token_ids)
        if self.moved_at is not None and any(frame.token_ids for frame in frames):
            # another worker continues the stream: the move is done (one that none continued is not counted)
            replayed = len(self.sent) - sum(len(frame.token_ids) for frame in frames)
            self.metrics.migrations.labels(self.move_cause).inc()
            self.metrics.migrated_tokens.inc(replayed)
            self.metrics.migration_gap.observe(time.monotonic() - self.moved_at)
            self.metrics.migration_held_tokens.inc(frames[0].num_cached_tokens)  # the first frame says
            self.moved_at = self.precopied_to = None
        if self.moves:  # a moved stream's frames say nothing of the prompt's cache hits
            for frame in frames:
                frame.num_cached_tokens = 0

    @property
    def may_move(self) -> bool:
        return self.moves < self.limit

    def resumed_route(self, route: Route) -> Route:
        """``route`` for the stream's next worker: the KV from the worker it left if that one
        handed it over, else computed there."""
        if self.kv_source is None or self.kv_source.worker_id == route.decode.worker_id:
            return dataclasses.replace(route, prefill=None, reason="a moved stream")
        return dataclasses.replace(route, prefill=self.kv_source, reason="a moved stream's KV from the worker it left")

    def last_resort(self, workers: list[WorkerInfo]) -> WorkerInfo | None:
        """Of ``workers`` (routable ones), the decode worker to continue the stream where no active
        one can: a draining or drained one (it takes a moved stream and decodes it to its end,
        ``Worker.accepts``), the one that last handed the stream over first -- its cache holds the
        stream's KV.  The stream moved because the worker a drain handed it to died: waiting for an
        active one to come back would fail it, with a live worker at hand."""
        spare = [w for w in workers if w.state in ("draining", "idle") and w.role in ("decode", "both")]
        rank = {worker_id: i for i, worker_id in enumerate(self.drained_from)}
        return max(spare, key=lambda w: rank.get(w.worker_id, -1), default=None)

    def start_precopy(self, copy: Callable[[], Awaitable[WorkerInfo | None]]) -> None:
        """Run ``copy`` (which pre-copies the stream's KV and returns the worker it went to, or
        None) unless one is in flight or the stream cannot move."""
        if self.may_move and self.sent and (self.precopy is None or self.precopy.done()):
            self.precopy = asyncio.ensure_future(self._precopy(copy))

    async def _precopy(self, copy: Callable[[], Awaitable[WorkerInfo | None]]) -> None:
        try:
            self.precopied_to = await copy()
        except Exception as exc:  # the hand-over still moves the stream: all of its KV then
            log.info("pre-copy of a stream's KV failed: %s: %s", type(exc).__name__, exc)
            self.precopied_to = None
        self.metrics.precopies.labels("ok" if self.precopied_to else "failed").inc()

    def close(self) -> None:
        """The request has ended: a pre-copy still in flight is of no use."""
        if self.precopy is not None:
            self.precopy.cancel()

    def move(self, cause: str, kv_source: WorkerInfo | None = None) -> bool:
        """Whether the stream moves on after its worker was lost or handed it over (``cause``,
        ``kv_source``: that worker, whose cache holds the stream); the move is counted once another
        worker continues the stream (``passed_on``)."""
        if not self.may_move:
            return False
        self.moves += 1
        self.kv_source = kv_source
        if cause == "drain" and kv_source is not None:
            self.drained_from.append(kv_source.worker_id)
        self.moved_at, self.move_cause = time.monotonic(), cause
        return True
