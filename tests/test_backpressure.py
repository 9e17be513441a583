"""The gateway's wait queue (bounded, deadlines, oldest first) and its count of requests sent to
decode workers that their heartbeats do not show yet."""
from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from common.cluster.registry import Capacity, KVAddress, WorkerInfo
from gateway.backpressure import Saturated, WaitQueue
from gateway.dispatch import SentToDecode


async def test_waiters_wake_oldest_first():
    queue = WaitQueue(size=3, timeout_s=60)
    order = []

    async def waiter(name):
        await queue.wait(queue.deadline(), "busy")
        order.append(name)

    tasks = [asyncio.create_task(waiter(n)) for n in ("a", "b", "c")]
    while queue.waiting < 3:
        await asyncio.sleep(0)
    queue.notify(1)
    await tasks[0]
    assert order == ["a"] and queue.waiting == 2
    queue.notify_all()
    await asyncio.gather(*tasks)
    assert order == ["a", "b", "c"] and queue.waiting == 0


async def test_a_request_that_waits_again_keeps_its_place():
    """Woken but still without room (a long prompt: decode workers keep room building up for it),
    a request waits again ahead of those that came after it, not behind them."""
    queue = WaitQueue(size=3, timeout_s=60)
    woken = []
    long_deadline = queue.deadline()

    async def waiter(name, deadline, times=1):
        for _ in range(times):
            await queue.wait(deadline, "busy")
            woken.append(name)

    first = asyncio.create_task(waiter("long", long_deadline, times=2))
    while queue.waiting < 1:
        await asyncio.sleep(0)
    later = [asyncio.create_task(waiter(n, queue.deadline())) for n in ("s1", "s2")]
    while queue.waiting < 3:
        await asyncio.sleep(0)
    queue.notify(1)
    while queue.waiting < 3:  # woken, found no room, waits again
        await asyncio.sleep(0)
    assert woken == ["long"]
    queue.notify(1)
    while len(woken) < 2:
        await asyncio.sleep(0)
    assert woken == ["long", "long"]
    await first
    queue.notify_all()
    await asyncio.gather(*later)
    assert woken == ["long", "long", "s1", "s2"]


async def test_a_full_queue_refuses_at_once():
    queue = WaitQueue(size=1, timeout_s=60)
    first = asyncio.create_task(queue.wait(queue.deadline(), "every decode worker is busy"))
    while queue.waiting < 1:
        await asyncio.sleep(0)
    with pytest.raises(Saturated, match="1 requests are already waiting") as info:
        await queue.wait(queue.deadline(), "every decode worker is busy")
    assert info.value.retry_after >= 1
    queue.notify()
    await first
    with pytest.raises(Saturated, match="already waiting"):
        await WaitQueue(size=0, timeout_s=1).wait(time.monotonic() + 10, "busy")


async def test_the_deadline_ends_the_wait():
    queue = WaitQueue(size=4, timeout_s=0.05)
    deadline = queue.deadline()
    with pytest.raises(Saturated, match="busy within"):
        await queue.wait(deadline, "every decode worker is busy")  # nobody notifies
    assert queue.waiting == 0
    with pytest.raises(Saturated):  # a later wait of the same request: already past its deadline
        await queue.wait(deadline, "busy")


async def test_a_cancelled_waiter_leaves_the_queue():
    queue = WaitQueue(size=1, timeout_s=60)
    task = asyncio.create_task(queue.wait(queue.deadline(), "busy"))
    while queue.waiting < 1:
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert queue.waiting == 0
    queue.notify()  # nothing to wake, nothing breaks


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
