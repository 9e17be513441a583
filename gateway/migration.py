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

At most ``limit`` moves per request (``--migration-limit``; 0 turns it off: a lost worker ends
the stream with an error, a draining worker decodes its streams to the end).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from common.cluster.messages import TokenFrame
from common.cluster.registry import WorkerInfo
from gateway.metrics import GatewayMetrics
from gateway.routing import Route


@dataclass
class StreamMigration:
    """One request's moves: the tokens its client has, and how many moves are left."""

    limit: int
    metrics: GatewayMetrics
    sent: list[int] = field(default_factory=list)  # output tokens passed on to the client
    moves: int = 0
    kv_source: WorkerInfo | None = None  # the draining worker the stream left, which holds its KV
    moved_at: float | None = None  # when it last moved, until its next token

    def passed_on(self, frames: list[TokenFrame]) -> None:
        """``frames`` go to the client now."""
        for frame in frames:
            self.sent.extend(frame.token_ids)
        if self.moved_at is not None and any(frame.token_ids for frame in frames):
            self.metrics.migration_gap.observe(time.monotonic() - self.moved_at)
            self.moved_at = None
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

    def move(self, cause: str, kv_source: WorkerInfo | None = None) -> bool:
        """Whether the stream moves on after its worker was lost or handed it over (``cause``,
        ``kv_source``: that worker, whose cache holds the stream); counts the move."""
        if not self.may_move:
            return False
        self.moves += 1
        self.kv_source = kv_source
        self.moved_at = time.monotonic()
        self.metrics.migrations.labels(cause).inc()
        self.metrics.migrated_tokens.inc(len(self.sent))
        return True
