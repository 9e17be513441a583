"""The nonces of accepted signed requests, so that none is accepted twice (``auth.RequestVerifier``).

A signed request is acceptable until its signed time plus the clock-skew allowance; its nonce is
remembered exactly that long, then forgotten (a replay after that is refused as stale anyway).

Bounded: at most ``capacity`` nonces.  Full, it takes a new nonce only from a request acceptable
for longer than the nonce that expires first, which it then forgets; a request acceptable no longer
than that is refused (it might be the replay of a nonce forgotten so).  Every nonce forgotten this
way expires no later than all those the cache holds from then on, and the cache stays full until
one of them expires; by then the forgotten one's request is stale.  So the cache never accepts a
replay, whatever the load: above its size it narrows the window of acceptable signing times from
the old end, and fresh requests still pass (unless more than ``capacity`` arrive signed in one second).

Only requests whose signature verified are remembered, so a caller without the cluster secret
cannot fill the cache.  Sizing: a nonce lives for the skew window (``MAX_CLOCK_SKEW_S`` = 300 s)
past its signing time, so the window stays whole up to ``capacity / 300 s`` accepted requests per
second (65,536 nonces: ~218 per second on one worker, about 200 bytes each, ~13 MiB when full).
Above that rate, requests signed more than ``capacity / rate`` seconds before they arrive are
refused (at 2,000 per second: 32 s), which callers that sign right before sending never are.
"""
from __future__ import annotations

import heapq

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
        self._expiry: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []  # (expiry, nonce), the first to expire on top

    def __len__(self) -> int:
        return len(self._expiry)

    def refusal(self, nonce: str, expires_at: float, now: float) -> str | None:
        """Why a request with this nonce, acceptable until ``expires_at``, must be refused (a
        replay, or too old to tell), or None.  Changes nothing but forgetting expired nonces."""
        self._forget_expired(now)
        if nonce in self._expiry:
            return REPLAYED
        if len(self._expiry) >= self.capacity and expires_at <= self._heap[0][0]:
            return TOO_OLD
        return None

    def remember(self, nonce: str, expires_at: float, now: float) -> str | None:
        """Remember the nonce of an accepted request: None when it is now remembered, else why the
        request must be refused instead (its nonce was remembered meanwhile, or it is too old to tell)."""
        why = self.refusal(nonce, expires_at, now)
        if why is not None:
            return why
        if len(self._expiry) >= self.capacity:
            _, first = heapq.heappop(self._heap)
            del self._expiry[first]
            self.evicted += 1
        self._expiry[nonce] = expires_at
        heapq.heappush(self._heap, (expires_at, nonce))
        return None

    def _forget_expired(self, now: float) -> None:
        heap = self._heap
        while heap and heap[0][0] < now:
            _, nonce = heapq.heappop(heap)
            del self._expiry[nonce]
