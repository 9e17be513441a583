"""The gateway's view of the worker pools (gateway/pool.py): what a refusal says when no decode
worker can be routed to."""
from __future__ import annotations

import msgspec

from gateway.pool import WorkerPool
from tests.support.dispatch_stubs import worker


def pool(*entries) -> WorkerPool:
    view = WorkerPool(registry=None, model="m")
    view.workers = [msgspec.structs.replace(worker(worker_id, role), state=state) for worker_id, role, state in entries]
    return view


def test_a_refusal_says_every_decode_worker_drains_when_they_all_do():
    """(It said "no decode worker is available", with Retry-After: 1, while every one was draining.)"""
    assert pool(("d0", "decode", "draining"), ("d1", "both", "idle"), ("p0", "prefill", "active")
                ).why_no_decode_worker() == "every decode worker (2) is draining or drained"
    assert pool(("d0", "decode", "draining"), ("d1", "decode", "active")).why_no_decode_worker() == \
        "no decode worker is available"
    assert pool(("p0", "prefill", "active")).why_no_decode_worker() == "no decode worker is available"
