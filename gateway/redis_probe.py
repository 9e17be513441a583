"""Whether Redis answers now, for ``/health``: asked with a bounded PING, not remembered from the
last failure.

The gateway learns about Redis from the registry refresh (every half second) and from prefix
lookups (only while requests come).  A lookup that timed out marks the prefix index unavailable
until a later lookup succeeds -- on an idle gateway, never -- so ``/health`` asks Redis itself
whenever the last thing it heard was bad.  One PING at a time, shared by every caller meanwhile
and bounded by ``timeout_s``.  Whatever Redis says is an answer: a PONG or a refusal of the
command (a ``ResponseError`` such as NOPERM when the ACL lacks PING: Redis is there, as
``redis_util.ping`` takes it) is a "yes"; no answer in time, a closed connection, or bytes that are
no Redis protocol is a "no".  A "yes" is kept for ``interval_s``, a "no" for ``min(timeout_s,
interval_s)``.  So a flood of ``/health`` calls costs Redis at most one PING per interval while it
answers and one per ``min(timeout_s, interval_s)`` while it does not (also when it fails at once),
and each caller at most ``timeout_s``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import redis.asyncio as aioredis
import redis.exceptions

from common.cluster.redis_util import UNAVAILABLE_ERRORS

log = logging.getLogger(__name__)


class RedisProbe:
    """``await answers()``: whether Redis answered its last PING (see the module docstring for what
    an answer is and how long one is kept; concurrent callers share the PING in flight)."""

    def __init__(self, client: aioredis.Redis, *, timeout_s: float, interval_s: float,
                 clock: Callable[[], float] = time.monotonic):
        if timeout_s <= 0 or interval_s < 0:
            raise ValueError(f"timeout_s must be > 0 and interval_s >= 0, got {timeout_s}, {interval_s}")
        self.client = client
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.clock = clock
        self._answer = False
        self._answered_at: float | None = None  # when the kept answer came; None: none is kept
        self._ping: asyncio.Task | None = None

    async def answers(self) -> bool:
        if self._ping is None and not self._fresh():
            self._ping = asyncio.get_running_loop().create_task(self._ask())
        if self._ping is not None:
            await asyncio.shield(self._ping)  # a caller that leaves does not cancel the others' PING
        return self._answer

    async def close(self) -> None:
        """Stop a PING in flight (before the client closes)."""
        if self._ping is not None:
            self._ping.cancel()
            await asyncio.gather(self._ping, return_exceptions=True)

    def _fresh(self) -> bool:
        if self._answered_at is None:
            return False
        keep = self.interval_s if self._answer else min(self.timeout_s, self.interval_s)
        return self.clock() - self._answered_at < keep

    async def _ask(self) -> None:
        self._answer, self._answered_at = False, None  # nothing stale survives a PING that fails oddly
        try:
            try:
                async with asyncio.timeout(self.timeout_s):
                    answer = bool(await self.client.ping())
            except redis.exceptions.ResponseError as exc:  # before RedisError: it is one
                log.debug("Redis refused the health PING (it answers): %r", exc)
                answer = True
            except (TimeoutError, *UNAVAILABLE_ERRORS, redis.exceptions.RedisError) as exc:
                log.debug("Redis did not answer a health PING: %r", exc)
                answer = False
            self._answer, self._answered_at = answer, self.clock()
        finally:
            self._ping = None
