"""How the chaos run explains the errors its clients got (benchmarks/chaos_checks.py): only what a
fault causes passes; any other 500, a 503 without Retry-After, a cut no kill explains, do not."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from benchmarks.chaos_checks import ERROR_CLASSES, classify_error

CUT = "generation failed: decode worker d1 failed mid-stream: Response payload is not completed"
KILLS = [("p0", 100.0), ("d1", 200.0)]


@dataclass
class Ended:
    status: int | None
    detail: str
    retry_after: str | None = None
    seconds: float = 10.0
    ended_at: float = 205.0  # began at 195: d1 was killed while it ran


@pytest.mark.parametrize("outcome, expected", [
    # A stream (error event) or a non-streamed answer (500) cut by the kill of the worker it names.
    (Ended(None, CUT), "decode_worker_killed"),
    (Ended(500, "Error code: 500 - {'error': {'message': '" + CUT + "'}}"), "decode_worker_killed"),
    # Backpressure, with the Retry-After a client needs.
    (Ended(503, "The server is saturated: every decode worker is busy within 15 s", retry_after="7"), "saturated"),
    (Ended(429, "This API key has 6 requests in flight, its limit", retry_after="1"), "rate_limited"),
    # Not explained by any fault:
    (Ended(500, "generation failed: engine step failed: injected fault"), None),
    (Ended(500, "generation failed: internal error: KeyError('x')"), None),
    (Ended(None, "generation failed: decode worker d0 failed mid-stream: reset"), None),  # d0 was never killed
    (Ended(None, CUT, ended_at=150.0), None),  # ended before d1's kill
    (Ended(None, CUT, seconds=1.0, ended_at=260.0), None),  # began after it
    (Ended(None, CUT.replace("d1", "p0")), None),  # p0 was killed, but before this request began
    (Ended(503, "The server is saturated: every decode worker is busy"), None),  # no Retry-After
    (Ended(503, "decode worker refused", retry_after="1"), None),  # not saturation
    (Ended(400, "temperature must be >= 0"), None),
])
def test_only_errors_a_fault_causes_are_explained(outcome, expected):
    assert classify_error(outcome, KILLS) == expected
    assert expected is None or expected in ERROR_CLASSES
