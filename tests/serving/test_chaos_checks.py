"""How the chaos run explains the errors its clients got (benchmarks/chaos_checks.py): only what a
fault causes passes; any other 500, a 503 without Retry-After, a cut no kill explains, do not."""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from benchmarks.chaos_checks import ERROR_CLASSES, classify_error, migrations_so_far, streams_moved

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


class _Metrics(BaseHTTPRequestHandler):
    """A gateway's /metrics whose migration counter goes up at the third read; the second fails."""

    reads = 0

    def do_GET(self):
        type(self).reads += 1
        if type(self).reads == 2:
            self.send_error(503)
            return
        body = f"pdserve_migrations_total{{cause=\"worker_lost\"}} {int(type(self).reads >= 3)}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_decode_kill_waits_until_the_gateway_has_moved_the_streams():
    """The chaos run's next fault (Redis) waits for the gateway to move the killed worker's streams:
    Redis dying first left it no decode worker to move them to (0 migrations, once)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"

    async def scenario():
        witness = asyncio.get_running_loop().create_future()
        before = migrations_so_far(url)
        moved = await streams_moved(url, before, witness, timeout_s=30)
        witness.set_result(None)
        ended = await streams_moved(url, migrations_so_far(url), witness, timeout_s=30)
        return before, moved, ended, await streams_moved(url, None, asyncio.Future(), timeout_s=30)

    try:
        # moved (past a failed read); the witness ended; unknown before the kill
        assert asyncio.run(scenario()) == (0.0, True, False, False)
        assert _Metrics.reads >= 3
    finally:
        server.shutdown()
        server.server_close()
