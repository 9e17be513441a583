"""Recent load signals a worker reports in its registry entry: latencies and the prefill rate."""
from __future__ import annotations

import time
from collections import deque


class RecentLatency:
    """Mean of the last few observations (TTFT, TPOT) reported in the registry."""

    def __init__(self, size: int = 64):
        self.values: deque[float] = deque(maxlen=size)

    def add(self, value: float) -> None:
        self.values.append(value)

    @property
    def mean(self) -> float | None:
        return sum(self.values) / len(self.values) if self.values else None


class RecentRate:
    """Rate of a growing counter over the last ``window_s`` seconds (prefill tokens computed per
    second, reported in the registry for ``pdctl rebalance``).  Fed one sample per heartbeat."""

    def __init__(self, window_s: float = 20.0):
        self.window_s = window_s
        self.samples: deque[tuple[float, float]] = deque()

    def update(self, count: float, now: float | None = None) -> float:
        """Record ``count`` at ``now``; return the rate since the oldest sample in the window."""
        now = time.monotonic() if now is None else now
        self.samples.append((now, count))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        (t0, c0), (t1, c1) = self.samples[0], self.samples[-1]
        return max(0.0, (c1 - c0) / (t1 - t0)) if t1 > t0 else 0.0
