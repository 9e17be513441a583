"""A bounded record of the engine's recent steps: when each ended, how long it took, and its shape.

A step's shape is five numbers taken from the scheduler's output (``step_shape``)::

    tokens   sum of q                      tokens computed (prefill chunks + one per decode)
    seqs     number of requests in the step
    samples  requests that sample a token  (decodes, and prompts whose last chunk ran)
    pairs    sum of q * (s + (q + 1) / 2)  (query, key) pairs of attention
    context  sum of (s + q)                KV tokens the step reads
             -- for a request with s tokens already computed and q scheduled now

These are the features of the planner's cost model (``pdctl.planner.cost_model``), so a running
worker's log is what ``pdctl calibrate --live`` fits a cost model to, and what the planner's
validation compares with the machine's speed during a run.  The engine thread appends; any thread
reads (``since``), under a lock.  Storage is one preallocated array, overwritten oldest first.
"""
from __future__ import annotations

import threading

import numpy as np

COLUMNS = ("ended_at", "seconds", "tokens", "seqs", "samples", "pairs", "context")
DEFAULT_CAPACITY = 16384  # rows (56 bytes each): minutes of a busy worker's steps


def step_shape(scheduled) -> tuple[int, int, int, float, int]:
    """``(tokens, seqs, samples, pairs, context)`` of a step's ``ScheduledRequest`` list."""
    tokens = samples = context = 0
    pairs = 0.0
    for item in scheduled:
        q = len(item.token_ids)
        s = item.num_computed_tokens
        tokens += q
        context += s + q
        pairs += q * (s + (q + 1) * 0.5)
        if item.sample:
            samples += 1
    return tokens, len(scheduled), samples, pairs, context


class StepLog:
    """The last ``capacity`` steps as rows of ``COLUMNS`` (``ended_at`` is wall-clock time, so
    the logs of workers on one host line up)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"a step log holds at least one step, got capacity {capacity}")
        self.capacity = capacity
        self._rows = np.zeros((capacity, len(COLUMNS)))
        self._count = 0  # steps ever recorded; the newest is at (count - 1) % capacity
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return min(self._count, self.capacity)

    @property
    def total(self) -> int:
        """Steps recorded since start, including those overwritten."""
        return self._count

    def record(self, ended_at: float, seconds: float, shape: tuple) -> None:
        with self._lock:
            row = self._rows[self._count % self.capacity]
            row[0] = ended_at
            row[1] = seconds
            row[2:] = shape
            self._count += 1

    def since(self, after: float = float("-inf"), limit: int | None = None) -> np.ndarray:
        """Rows of steps that ended after ``after``, oldest first, at most ``limit`` (the oldest
        ones: page on with the last row's ``ended_at``)."""
        with self._lock:
            n = len(self)
            start = self._count - n
            order = (np.arange(start, self._count) % self.capacity) if n else np.zeros(0, dtype=int)
            rows = self._rows[order]
        rows = rows[rows[:, 0] > after]
        return rows if limit is None else rows[:limit]
