"""The nonces of accepted signed requests, so that none is accepted twice (``auth.RequestVerifier``).

A signed request is acceptable until its signed time plus the clock-skew allowance; its nonce is
remembered exactly that long, then forgotten (a replay after that is refused as stale anyway).

A nonce is taken as soon as the request's signature verifies, before its body is read, so that of
several copies arriving at once only one gets its body read.  If that request is then not served
(its body is not the one signed, it never arrived, the caller left), the nonce is ``release``d:
nothing was done with it, so the request may still be sent once.

Bounded: at most ``capacity`` nonces.  Full, it takes a new nonce only from a request acceptable
for longer than the nonce that expires first, which it then forgets; from then on it refuses every
request acceptable no longer than the latest expiry it ever forgot so (``evicted_until``: such a
request might be the replay of a forgotten nonce) -- until that time has passed, when those
requests are stale anyway.  So the cache never accepts a replay, whatever the load (and whatever
was released meanwhile): above its size it narrows the window of acceptable signing times from the
old end, and fresh requests still pass (unless more than ``capacity`` arrive signed in one second).

Only requests whose signature verified are remembered, so a caller without the cluster secret
cannot fill the cache.  Sizing: a nonce lives for the skew window (``MAX_CLOCK_SKEW_S`` = 300 s)
past its signing time, so the window stays whole up to ``capacity / 300 s`` accepted requests per
second (65,536 nonces: ~218 per second on one worker, about 200 bytes each, ~13 MiB when full).
Above that rate, requests signed more than ``capacity / rate`` seconds before they arrive are
refused (at 2,000 per second: 32 s), which callers that sign right before sending never are.
"""
from __future__ import annotations

import heapq
import math

DEFAULT_CAPACITY = 65536
REPLAYED = "replayed cluster credentials (this nonce was already used)"
TOO_OLD = ("cluster credentials too old to check for a replay (the replay cache is full: requests signed this "
           "long ago are refused for now)")


class NonceCache:
    """Seen nonces with their expiry (unix seconds).  Not thread-safe: one event loop uses it."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.evicted = 0  # nonces forgotten before their expiry because the cache was full
        self.evicted_until = -math.inf  # the latest expiry of a nonce forgotten so
        self._expiry: dict[str, float] = {}
        # (expiry, nonce), the first to expire on top; an entry whose nonce was released (no longer
        # in _expiry with that expiry) is skipped when it surfaces.
        self._heap: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self._expiry)

    def refusal(self, nonce: str, expires_at: float, now: float) -> str | None:
        """Why a request with this nonce, acceptable until ``expires_at``, must be refused (a
        replay, or too old to tell), or None.  Changes nothing but forgetting expired nonces."""
        self._forget_expired(now)
        if nonce in self._expiry:
            return REPLAYED
        if expires_at <= self.evicted_until:
            return TOO_OLD
        if len(self._expiry) >= self.capacity and expires_at <= self._first()[0]:
            return TOO_OLD
        return None

    def remember(self, nonce: str, expires_at: float, now: float) -> str | None:
        """Take the nonce of a request about to be accepted: None when it is now remembered, else
        why the request must be refused instead (a replay, or too old to tell)."""
        why = self.refusal(nonce, expires_at, now)
        if why is not None:
            return why
        if len(self._expiry) >= self.capacity:
            first_expiry, first = self._first()
            heapq.heappop(self._heap)
            del self._expiry[first]
            self.evicted += 1
            self.evicted_until = max(self.evicted_until, first_expiry)
        self._expiry[nonce] = expires_at
        heapq.heappush(self._heap, (expires_at, nonce))
        return None

    def release(self, nonce: str) -> None:
        """Forget a nonce whose request was, after all, not served (see the module docstring)."""
        if self._expiry.pop(nonce, None) is not None and len(self._heap) > 2 * len(self._expiry) + 64:
            self._heap = [(expiry, n) for n, expiry in self._expiry.items()]  # only what is remembered
            heapq.heapify(self._heap)

    def _first(self) -> tuple[float, str]:
        """The (expiry, nonce) that expires first (the cache is not empty)."""
        heap = self._heap
        while self._expiry.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0]

    def _forget_expired(self, now: float) -> None:
        heap = self._heap
        while heap and heap[0][0] < now:
            expiry, nonce = heapq.heappop(heap)
            if self._expiry.get(nonce) == expiry:
                del self._expiry[nonce]
