"""A UCX payload whose sender freezes in its middle (SIGSTOP, a hung host) cannot be stopped from the
receiving side: UCX ends a receive it has matched only when the sender completes or fails.  The
transfer must fail all the same, within its bounds, and say that its blocks are not yet safe
(``IncomingTransfer.still_landing``), and the receiver must still close.

UCX picks shared memory and CMA between two processes on one host, which read the sender's memory
whether it runs or not; over its TCP transport (between hosts without RDMA) the sender's threads
push the payload, so both ends here run with ``UCX_TLS=tcp`` -- each in a process of its own, since
UCX reads it once per process (``kv_peer.py freeze``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow(seconds=20)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kv_peer.py")
ATTEMPTS = 5  # a payload that lands whole before the sender could be stopped is tried again


def test_a_sender_frozen_mid_payload_fails_the_transfer_and_keeps_its_blocks_out_of_use():
    pytest.importorskip("ucxx")
    for _ in range(ATTEMPTS):
        run = subprocess.run([sys.executable, PEER, "freeze", "--transport", "ucx"], cwd=REPO,
                             env={**os.environ, "UCX_TLS": "tcp"}, capture_output=True, text=True, timeout=300)
        events = [json.loads(line) for line in run.stdout.splitlines()]
        assert run.returncode == 0, f"the receiver failed after {events}: {run.stderr[-3000:]}"
        if events[-1]["event"] != "complete":
            break
    else:
        pytest.skip(f"the payload landed whole before its sender could be stopped, {ATTEMPTS} times")
    assert [e["event"] for e in events] == ["landing", "settled", "landing_ended", "closed"]
    # Settled although the payload was still landing (it hung there for ever), and said so.
    assert events[1]["still_landing"] is True
