"""Moving a live stream to another decode worker: replay.

When the decode worker of a stream that has started dies, stops answering, or drains and hands
the stream over (a "migrate" frame at a token boundary), the gateway -- which holds every token it
passed on -- sends the prompt and those tokens (``GenerateRequest.resume_token_ids``) to another
decode worker.  That worker computes their KV itself and continues as the first would have: the
tokens count toward ``max_tokens`` and the penalties, a seeded request draws at the next output
index, a grammar has advanced through them (``common.engine.request.resume_request``), and the
stop-string window lives here in the gateway's decoder.  The client sees one stream, without a
break, a duplicate or a lost token.

At most ``limit`` moves per request (``--migration-limit``; 0 turns it off: a lost worker ends
the stream with an error, a draining worker decodes its streams to the end).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.cluster.messages import TokenFrame
from gateway.metrics import GatewayMetrics


@dataclass
class StreamMigration:
    """One request's moves: the tokens its client has, and how many moves are left."""

    limit: int
    metrics: GatewayMetrics
    sent: list[int] = field(default_factory=list)  # output tokens passed on to the client
    moves: int = 0

    def passed_on(self, frames: list[TokenFrame]) -> None:
        """``frames`` go to the client now."""
        for frame in frames:
            self.sent.extend(frame.token_ids)
        if self.moves:  # a moved stream's frames say nothing of the prompt's cache hits
            for frame in frames:
                frame.num_cached_tokens = 0

    @property
    def may_move(self) -> bool:
        return self.moves < self.limit

    def move(self, cause: str) -> bool:
        """Whether the stream moves on after its worker was lost or handed it over (``cause``);
        counts the move."""
        if not self.may_move:
            return False
        self.moves += 1
        self.metrics.migrations.labels(cause).inc()
        self.metrics.migrated_tokens.inc(len(self.sent))
        return True
