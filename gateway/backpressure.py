"""Holding requests while every decode worker is busy: a bounded queue with a deadline.

    request --route--> D1: busy --> D2: busy --> (no decode worker left with room)
        --> WaitQueue.wait(deadline) ... woken when room may have appeared ... --> route again
        --> queue full, or deadline passed: Saturated (the client gets 503 + Retry-After)

Room may appear when one of this gateway's streams ends (``notify(1)``: one slot freed, one waiter
tries), when the registry refresh brings new loads (``notify(1)``: a probe, since other gateways'
streams end too), or when a decode worker joins (``notify_all``).  Waiters wake oldest first, and a
request that waits again (woken, but still no room) keeps its place: it is ordered by its deadline,
set when it first waited.  So a long prompt that needs more room than short ones is not sent to the
back each time (decode workers keep the room it needs for it: ``Scheduler.claim``).
"""
from __future__ import annotations

import asyncio
import bisect
import itertools


class Saturated(Exception):
    """No worker can take the request now (the client gets 503 with Retry-After)."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class WaitQueue:
    """At most ``size`` requests wait at once, each until its deadline (``timeout_s`` after it
    first found no room); ``size == 0`` disables waiting."""

    def __init__(self, size: int, timeout_s: float):
        if size < 0 or timeout_s <= 0:
            raise ValueError(f"queue size must be >= 0 and timeout > 0, got {size}, {timeout_s}")
        self.size = size
        self.timeout_s = timeout_s
        self._waiters: list[tuple[float, int, asyncio.Future]] = []  # (deadline, arrival, waiter), oldest first
        self._arrivals = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def deadline(self) -> float:
        return asyncio.get_running_loop().time() + self.timeout_s

    async def wait(self, deadline: float, why: str) -> None:
        """Wait until woken (room may have appeared) or raise ``Saturated`` (full, or past the
        deadline).  ``why`` says what the request found, for the 503's message."""
        loop = asyncio.get_running_loop()
        if len(self._waiters) >= self.size:
            raise Saturated(f"{why}, and {len(self._waiters)} requests are already waiting; retry shortly",
                            retry_after=max(1.0, self.timeout_s / 2))
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise Saturated(f"{why} within {self.timeout_s:g} s; retry shortly")
        entry = (deadline, next(self._arrivals), loop.create_future())
        bisect.insort(self._waiters, entry)
        try:
            async with asyncio.timeout(remaining):
                await entry[2]
        except TimeoutError:
            raise Saturated(f"{why} within {self.timeout_s:g} s; retry shortly") from None
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)

    def notify(self, n: int = 1) -> None:
        """Wake the ``n`` oldest waiters."""
        while n > 0 and self._waiters:
            waiter = self._waiters.pop(0)[2]
            if not waiter.done():
                waiter.set_result(None)
                n -= 1

    def notify_all(self) -> None:
        self.notify(len(self._waiters))
