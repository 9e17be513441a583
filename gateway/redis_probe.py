"""Whether Redis answers now, for ``/health``: asked with a bounded PING, not remembered from the
last failure.

The gateway learns about Redis from the registry refresh (every half second) and from prefix
lookups (only while requests come).  A lookup that timed out marks the prefix index unavailable
until a later lookup succeeds -- on an idle gateway, never -- so ``/health`` asks Redis itself
whenever the last thing it heard was bad.  One PING at a time, shared by every caller meanwhile
and bounded by ``timeout_s``; a "yes" is kept for ``interval_s``.  So a flood of ``/health`` calls
costs Redis at most one PING per interval while it answers and one per ``timeout_s`` while it
does not, and each caller at most ``timeout_s``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import redis.asyncio as aioredis

from common.cluster.redis_util import UNAVAILABLE_ERRORS

log = logging.getLogger(__name__)


class RedisProbe:
    """``await answers()``: True when Redis answered a PING within ``timeout_s`` (a "yes" is kept
    for ``interval_s``; concurrent callers share the PING in flight)."""

    def __init__(self, client: aioredis.Redis, *, timeout_s: float, interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        if timeout_s <= 0 or interval_s < 0:
            raise ValueError(f"timeout_s must be > 0 and interval_s >= 0, got {timeout_s}, {interval_s}")
        self.client = client
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.clock = clock
        self._answer = False
        self._answered_at: float | None = None  # when the kept "yes" came
        self._ping: asyncio.Task | None = None

    async def answers(self) -> bool:
        fresh = self._answered_at is not None and self.clock() - self._answered_at < self.interval_s
        if self._ping is None and not fresh:
            self._ping = asyncio.get_running_loop().create_task(self._ask())
        if self._ping is not None:
            await asyncio.shield(self._ping)  # a caller that leaves does not cancel the others' PING
        return self._answer

    async def close(self) -> None:
        """Stop a PING in flight (before the client closes)."""
        if self._ping is not None:
            self._ping.cancel()
            await asyncio.gather(self._ping, return_exceptions=True)

    async def _ask(self) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                self._answer = bool(await self.client.ping())
        except (TimeoutError, *UNAVAILABLE_ERRORS) as exc:
            log.debug("Redis did not answer a health PING: %r", exc)
            self._answer = False
        finally:
            self._answered_at = self.clock() if self._answer else None
            self._ping = None
