"""The gateway's view of the worker pools (gateway/pool.py): what a refusal says when no decode
worker can be routed to; its refreshes go on whatever the registry read does."""
from __future__ import annotations

import asyncio

import msgspec
import redis.exceptions

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


class _RefusingRegistry:
    """A registry (unit test of the pool above it) whose reads Redis refuses from the 2nd to the 4th."""

    def __init__(self, workers):
        self.workers, self.calls = workers, 0
        self.enough = asyncio.Event()

    async def list_workers(self, model):
        self.calls += 1
        if self.calls >= 6:
            self.enough.set()
        if 2 <= self.calls <= 4:
            raise redis.exceptions.ResponseError("MISCONF Redis is configured to save RDB snapshots, but it is "
                                                 "currently not able to persist on disk")
        return self.workers


async def test_a_refused_registry_read_neither_ends_the_refreshes_nor_silences_their_ticks():
    """A Redis error other than "unreachable" ended the background refresh for good (the pool froze as
    it was, /health said nothing); and while Redis was down the listeners heard nothing, so nothing
    woke the requests waiting in line (a benched worker back went unnoticed)."""
    registry = _RefusingRegistry([worker("d0", "decode")])
    view = WorkerPool(registry, "m", refresh_s=0.01)
    ticks, states = [], []
    view.listeners.append(lambda previous, current: (ticks.append(len(current)), states.append(view.redis_ok)))
    await view.start()
    try:
        await asyncio.wait_for(registry.enough.wait(), 60)
    finally:
        await view.stop()
    assert states[:5] == [True, False, False, False, True]  # every tick heard, Redis said down while it was
    assert set(ticks) == {1}  # the last known list throughout


class _HeldRegistry:
    """A registry (unit test of the pool above it) whose reads wait until the test lets them go."""

    def __init__(self):
        self.calls = 0
        self.release = asyncio.Event()

    async def list_workers(self, model):
        self.calls += 1
        await self.release.wait()
        return [worker(f"d{self.calls}", "decode")]


async def test_refreshes_asked_for_at_once_share_one_read_begun_after_they_asked():
    """A drain's hand-overs each ask for a refresh at once: K reads of the registry, each walking every
    entry, whose results could land out of order (an older list over a newer one).  They share one
    -- and not one begun before they asked, which may not hold what changed before (a worker's new
    state, just set)."""
    registry = _HeldRegistry()
    view = WorkerPool(registry, "m")
    first = asyncio.ensure_future(view.refresh())  # a tick's read, under way
    await asyncio.sleep(0)
    asked = [asyncio.ensure_future(view.refresh()) for _ in range(5)]  # then the hand-overs ask
    await asyncio.sleep(0)
    registry.release.set()
    await asyncio.wait_for(asyncio.gather(first, *asked), 60)
    assert registry.calls == 2 and [w.worker_id for w in view.workers] == ["d2"]
    await view.refresh()  # a later one reads again
    assert registry.calls == 3
