"""The gateway's count of requests sent to decode workers that their heartbeats do not show yet
(gateway.decode_load.SentToDecode)."""
from __future__ import annotations

import time

import msgspec

from common.cluster.registry import Capacity, KVAddress, WorkerInfo
from gateway.decode_load import SentToDecode


def worker(worker_id: str, heartbeat_at: float) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="decode", model="m", http_address="http://x:1",
                      kv_address=KVAddress("tcp", "x", 2), capacity=Capacity(100, 16, 8), heartbeat_at=heartbeat_at)


def test_sent_requests_count_until_a_heartbeat_after_their_first_token():
    sent = SentToDecode()
    sent.add("d0", "r1", blocks=3)
    sent.add("d0", "r2", blocks=5)
    sent.add("d1", "r3", blocks=1)
    old = worker("d0", heartbeat_at=time.time() - 1)
    assert sent.load([old, worker("d1", 0.0)]) == {"d0": (2, 8), "d1": (1, 1)}
    sent.admitted("d0", "r1")
    # A heartbeat from before r1 was admitted does not show it yet ...
    assert sent.load([old]) == {"d0": (2, 8)}
    # ... one stamped after does: r1 leaves the gateway's own count, r2 (no token yet) stays.
    fresh = msgspec.structs.replace(old, heartbeat_at=time.time() + 1)
    assert sent.load([fresh]) == {"d0": (1, 5)}
    sent.remove("d0", "r2")  # finished (or refused) before any heartbeat
    assert sent.load([fresh]) == {}
