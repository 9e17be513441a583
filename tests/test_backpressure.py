"""The gateway's wait queue (bounded, deadlines, strictly first come first served, no lost wake-up)
and its count of requests sent to decode workers that their heartbeats do not show yet.

The queue is tested as a state machine (hypothesis) on an event loop whose clock moves only when
the test says so: requests arrive, try for room and get their answers late, streams end, the
registry refresh probes, decode workers join, clients leave, time passes; and examples pin each
rule of the module docstring."""
from __future__ import annotations

import asyncio
import os
import time

import msgspec
import pytest
from hypothesis import Phase, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from common.cluster.registry import Capacity, KVAddress, WorkerInfo
from gateway.backpressure import Place, Saturated, WaitQueue
from gateway.dispatch import SentToDecode


async def settle() -> None:
    """Run every task that can run (the clock does not move)."""
    loop = asyncio.get_running_loop()
    for _ in range(10_000):
        await asyncio.sleep(0)
        if not loop._ready and not any(h.when() <= loop.time() for h in loop._scheduled if not h.cancelled()):
            return
    raise AssertionError("tasks never settled")


class Request:
    """A request as the dispatcher drives its place: try, then no room or admitted; ``tries``
    counts the tries started, ``outcome`` is how it ended."""

    def __init__(self, queue: WaitQueue, room: list[int], hold: bool = False):
        self.place = queue.place()
        self.room = room  # [free slots], shared
        self.hold = hold  # each try's answer waits until the test sets ``answer``
        self.tries = 0
        self.outcome: str | None = None
        self.answer: asyncio.Future | None = None

    async def run(self) -> None:
        try:
            while True:
                await self.place.turn()
                self.tries += 1
                got = self.room[0] > 0  # decided as the try starts; the answer may come later
                if got:
                    self.room[0] -= 1
                if self.hold:
                    self.answer = asyncio.get_running_loop().create_future()
                    await self.answer
                if got:
                    self.place.admitted()
                    self.outcome = "admitted"
                    return
                self.place.no_room("every decode worker is busy")
        except Saturated as exc:
            self.outcome = str(exc)
        finally:
            self.place.leave()


async def start(queue: WaitQueue, room: list[int], n: int, hold: bool = False) -> list[tuple[Request, asyncio.Task]]:
    out = []
    for _ in range(n):
        request = Request(queue, room, hold)
        out.append((request, asyncio.create_task(request.run())))
        await settle()
    return out


async def test_requests_are_woken_oldest_first():
    queue, room = WaitQueue(size=3, timeout_s=60), [0]
    requests = await start(queue, room, 3)
    assert queue.waiting == 3 and [r.tries for r, _ in requests] == [1, 0, 0]  # only the first found the queue empty
    for expected in range(3):
        room[0] += 1
        queue.notify(1)
        await settle()
        assert [r.outcome == "admitted" for r, _ in requests] == [i <= expected for i in range(3)]
    assert queue.waiting == 0


async def test_a_woken_request_that_finds_no_room_keeps_its_place_ahead_of_newcomers():
    """Size 2: A and B wait; A is woken and tries (its answer still on the way).  A newcomer finds
    the line full -- A still holds its place -- and A, finding no room, waits again ahead of B."""
    queue, room = WaitQueue(size=2, timeout_s=60), [0]
    (a, _), (b, _) = await start(queue, room, 2)
    assert a.tries == 1 and b.tries == 0
    a.hold = True
    queue.notify(1)  # a probe: room may have appeared
    await settle()
    assert a.tries == 2 and not a.answer.done()
    newcomer = Request(queue, room)
    await newcomer.run()
    assert "2 requests are already waiting" in newcomer.outcome and newcomer.tries == 0
    a.answer.set_result(None)  # no room this time either: A waits again, at the head
    await settle()
    room[0] = 1
    queue.notify(1)
    await settle()
    assert a.tries == 3 and b.tries == 0
    a.answer.set_result(None)
    await settle()
    assert a.outcome == "admitted" and b.outcome is None


async def test_a_newcomer_queues_behind_waiting_requests():
    queue, room = WaitQueue(size=4, timeout_s=60), [0]
    (first, _), = await start(queue, room, 1)
    room[0] = 1  # room appears, nobody has been told yet
    (newcomer, _), = await start(queue, room, 1)
    assert newcomer.tries == 0 and room[0] == 1  # it did not take the room ahead of the waiting one
    queue.notify(1)
    await settle()
    assert first.outcome == "admitted" and newcomer.outcome is None and newcomer.tries == 1  # woken by the chain


async def test_a_wake_up_landing_on_a_request_whose_client_left_is_passed_on():
    queue, room = WaitQueue(size=3, timeout_s=60), [0]
    (a, task_a), (b, _) = await start(queue, room, 2)
    room[0] = 1
    queue.notify(1)  # wakes A ...
    task_a.cancel()  # ... whose client leaves before it runs
    await settle()
    assert task_a.cancelled() and b.outcome == "admitted" and queue.waiting == 0


async def test_a_wake_up_that_finds_everyone_trying_is_not_lost():
    """Room appears while the only request is trying (the worker said busy before it was freed):
    the request tries again instead of waiting for the next notification."""
    queue, room = WaitQueue(size=3, timeout_s=60), [0]
    (a, _), = await start(queue, room, 1, hold=True)
    room[0] = 1
    queue.notify(1)  # nobody waits: A is trying
    a.answer.set_result(None)  # "busy", as decided before the room appeared
    await settle()
    assert a.tries == 2
    a.answer.set_result(None)
    await settle()
    assert a.outcome == "admitted"


async def test_a_full_queue_refuses_at_once():
    queue, room = WaitQueue(size=1, timeout_s=60), [0]
    await start(queue, room, 1)
    late = Request(queue, room)
    await late.run()
    assert "1 requests are already waiting" in late.outcome
    zero = Request(WaitQueue(size=0, timeout_s=1), [0])
    await zero.run()
    assert "already waiting" in zero.outcome and zero.tries == 1


async def test_the_deadline_ends_the_wait():
    queue = WaitQueue(size=4, timeout_s=0.05)
    request = Request(queue, [0])
    await request.run()  # nobody notifies
    assert request.outcome == "every decode worker is busy within 0.05 s; retry shortly"
    assert queue.waiting == 0


async def test_a_cancelled_waiter_leaves_the_queue():
    queue, room = WaitQueue(size=1, timeout_s=60), [0]
    (_, task), = await start(queue, room, 1)
    task.cancel()
    await settle()
    assert queue.waiting == 0
    queue.notify(1)  # nothing to wake, nothing breaks


async def test_a_request_that_leaves_its_place_unwoken_wakes_nobody():
    queue = WaitQueue(size=3, timeout_s=60)
    (a, first), (b, second) = await in_line(queue, 2)
    first.cancel()  # its client left while it waited: it held no wake-up
    await settle()
    a.leave()
    await settle()
    assert not second.done() and queue.waiting == 1
    second.cancel()


# ---- each rule of a Place, driven by hand -------------------------------------------------------


async def in_line(queue: WaitQueue, n: int) -> list[tuple[Place, asyncio.Task]]:
    """``n`` requests waiting in line, oldest first (the first found the line empty and tried)."""
    out = []
    for _ in range(n):
        place = queue.place()
        if not queue.waiting:
            assert await place.turn() is False  # a newcomer facing an empty line tries at once
            place.no_room("every decode worker is busy")
        out.append((place, asyncio.create_task(place.turn())))
        await settle()
        assert not out[-1][1].done()
    return out


async def test_turn_says_whether_the_request_waited_and_a_request_still_trying_never_waits():
    queue = WaitQueue(size=2, timeout_s=60)
    (a, first), = await in_line(queue, 1)
    queue.notify(1)
    await settle()
    assert first.result() is True  # it waited in line
    assert await a.turn() is False  # one worker said busy, it tries the next: no wait, no place lost
    assert queue.waiting == 1 and a.queued


async def test_a_request_that_gets_room_gives_its_place_up_at_once_and_queues_at_the_back_if_it_loses_it():
    queue = WaitQueue(size=3, timeout_s=60)
    (a, first), (b, second) = await in_line(queue, 2)
    queue.notify(1)
    await settle()
    assert first.done() and not second.done()
    a.admitted()  # its stream runs on; its place is free now
    assert queue.waiting == 1 and not a.queued
    await settle()
    assert second.done()  # the next in line was woken (more room may be free)
    b.no_room("every decode worker is busy")
    again = asyncio.create_task(b.turn())
    await settle()
    assert await a.turn() is False  # its worker failed before the first token: it tries again at once
    a.no_room("every decode worker is busy")  # and finds no room: it queues behind B
    back = asyncio.create_task(a.turn())
    await settle()
    assert a.ticket > b.ticket
    queue.notify(1)
    await settle()
    assert again.done() and not back.done()  # B, ahead of it now, is woken first
    back.cancel()


async def test_a_woken_request_hands_its_turn_to_an_older_one_back_in_line():
    """A (older) is trying; B is woken; before B runs, A found no room and is back in line: the
    turn is A's, and B waits again."""
    queue = WaitQueue(size=3, timeout_s=60)
    (a, first), (b, second), (c, third) = await in_line(queue, 3)
    queue.notify(1)
    await settle()
    assert first.done()
    a.no_room("every decode worker is busy")
    a_again = asyncio.create_task(a.turn())  # runs before B wakes up: A is back in line first
    queue.notify(1)  # nobody but B and C waits yet: B is woken
    await settle()
    assert a_again.done() and a_again.result() is True and not second.done()
    second.cancel()  # B waits again holding no wake-up: its leaving wakes nobody
    await settle()
    b.leave()
    await settle()
    assert not third.done()
    third.cancel()


async def test_a_notification_that_reached_a_waiting_request_does_not_make_a_trying_one_try_again():
    queue = WaitQueue(size=3, timeout_s=60)
    (a, first), (b, second) = await in_line(queue, 2)
    queue.notify(1)
    await settle()
    queue.notify(1)  # B is woken: the notification was heard
    await settle()
    a.no_room("every decode worker is busy")
    a_again = asyncio.create_task(a.turn())
    await settle()
    assert second.done() and not a_again.done()  # A waits; it does not try again on B's notification
    a_again.cancel()


async def test_an_unheard_notification_goes_to_the_oldest_in_line_only():
    queue = WaitQueue(size=3, timeout_s=60)
    (a, first), (b, second) = await in_line(queue, 2)
    queue.notify_all()
    await settle()
    assert first.done() and second.done()  # both trying
    queue.notify(1)  # nobody waits: unheard
    (c, third), = await in_line(queue, 1)  # a newcomer queues behind them
    a.no_room("every decode worker is busy")
    a_again = asyncio.create_task(a.turn())
    await settle()
    assert a_again.done() and not third.done()  # A, oldest, tries again; C still waits
    third.cancel()


async def test_a_request_tries_again_once_for_a_notification_nobody_heard():
    queue = WaitQueue(size=3, timeout_s=60)
    a = queue.place()
    assert await a.turn() is False
    queue.notify(1)  # while A tries: nobody waits
    a.no_room("every decode worker is busy")  # "busy", said before the room appeared
    assert await a.turn() is True  # it queues and is woken at once: it tries again
    a.no_room("every decode worker is busy")  # no room after all, and no notification since
    again = asyncio.create_task(a.turn())
    await settle()
    assert not again.done()  # it waits now
    again.cancel()


async def test_a_request_that_leaves_while_trying_passes_its_wake_up_on():
    queue = WaitQueue(size=3, timeout_s=60)
    (a, first), (b, second), (c, third) = await in_line(queue, 3)
    queue.notify(1)
    await settle()
    assert first.done()
    a.leave()  # its client left while it was routing: it took no room
    await settle()
    assert second.done() and not third.done()  # one wake-up, passed to the next in line
    third.cancel()


async def test_notify_all_wakes_everyone_in_line_at_once():
    queue = WaitQueue(size=4, timeout_s=60)
    line = await in_line(queue, 3)
    queue.notify_all()
    await settle()
    assert all(task.done() for _, task in line)


async def test_the_deadline_holds_for_every_wait_of_a_request_and_retry_after_is_set():
    queue = WaitQueue(size=2, timeout_s=0.05)
    (a, first), = await in_line(queue, 1)
    queue.notify(1)
    await settle()
    assert first.done()
    await asyncio.sleep(0.06)  # past its deadline while it tries
    a.no_room("every decode worker is busy")
    with pytest.raises(Saturated, match="every decode worker is busy within 0.05 s") as info:
        await a.turn()
    assert info.value.retry_after == 1.0
    full = WaitQueue(size=1, timeout_s=60)
    await in_line(full, 1)
    with pytest.raises(Saturated, match="no decode worker has room, and 1 requests are already waiting") as info:
        await full.place().turn()
    assert info.value.retry_after == 30.0  # half the queue's timeout
    short = WaitQueue(size=1, timeout_s=1)
    await in_line(short, 1)
    with pytest.raises(Saturated) as info:
        await short.place().turn()
    assert info.value.retry_after == 1.0  # at least a second


async def test_a_place_is_used_once_and_the_queue_is_checked():
    queue = WaitQueue(size=1, timeout_s=1)
    place = queue.place()
    place.leave()
    place.leave()  # idempotent
    with pytest.raises(RuntimeError, match=r"^turn\(\) after leave\(\)$"):
        await place.turn()
    for size, timeout in ((-1, 1), (1, 0)):
        with pytest.raises(ValueError, match="queue size must be >= 0 and timeout > 0"):
            WaitQueue(size, timeout)


# ---- the state machine ---------------------------------------------------------------------------


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only when the test advances it."""

    def __init__(self):
        super().__init__()
        self.now = 0.0

    def time(self) -> float:
        return self.now


class Model(Request):
    """A request of the state machine: its try's answer comes when a rule delivers it; it checks
    the FIFO rule as each try starts."""

    def __init__(self, machine: "QueueMachine"):
        super().__init__(machine.queue, machine.room)
        self.machine = machine

    async def run(self) -> None:
        queue, place = self.machine.queue, self.place
        got = False
        try:
            while True:
                await place.turn()
                older_waiting = [t for t, _ in queue._waiting if place.ticket is None or t < place.ticket]
                assert not older_waiting, f"ticket {place.ticket} tries while {older_waiting} wait"
                if place.ticket is None:
                    assert not queue._places, "a newcomer tried ahead of requests in line"
                self.tries += 1
                got = self.room[0] > 0
                if got:
                    self.room[0] -= 1
                self.answer = asyncio.get_running_loop().create_future()
                await self.answer
                if got:
                    place.admitted()
                    self.outcome = "admitted"
                    self.machine.streams += 1
                    return
                place.no_room("every decode worker is busy")
        except Saturated as exc:
            self.outcome = str(exc)
            if "already waiting" in self.outcome:
                assert len(queue._places) >= queue.size
            else:
                assert asyncio.get_running_loop().time() >= place.deadline
        except asyncio.CancelledError:
            self.outcome = "cancelled"
            if got:  # the dispatcher closes the stream: the slot is free again
                self.room[0] += 1
                self.machine.queue.notify(1)
            raise
        finally:
            place.leave()


class QueueMachine(RuleBasedStateMachine):
    """Rules change the world; each then runs the loop until it settles, or not (so that several
    changes land before any request runs: a wake-up and its client leaving, a stream ending while
    the only request in line is trying).  Invariants hold in every state; "no lost wake-up" once
    the loop has settled: room is free while somebody waits only if a try is still on its way
    (its end wakes the next or tries again)."""

    def __init__(self):
        super().__init__()
        self.loop = VirtualClockLoop()
        self.queue = WaitQueue(size=4, timeout_s=10.0)
        self.room = [0]  # decode slots free; two streams hold the others at the start
        self.streams = 2  # streams running, of requests admitted before the machine started or by it
        self.requests: list[tuple[Model, asyncio.Task]] = []
        self.settled = True

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def live(self, predicate) -> list[Model]:
        return [r for r, task in self.requests if not task.done() and predicate(r)]

    def pending_answers(self) -> list[Model]:
        return self.live(lambda r: r.answer is not None and not r.answer.done())

    def then(self, settle_now: bool) -> None:
        self.settled = False
        if settle_now:
            self.settle()

    @initialize(n=st.integers(0, 4))
    def requests_in_line(self, n):
        """``n`` requests that found no room wait in line."""
        for _ in range(n):
            self.arrive(settle_now=True)
            self.answers_arrive(None, every=True, settle_now=True)

    @precondition(lambda self: len(self.requests) < 16)
    @rule(settle_now=st.booleans())
    def arrive(self, settle_now):
        request = Model(self)
        self.requests.append((request, self.loop.create_task(request.run())))
        self.then(settle_now)

    @rule(data=st.data(), every=st.booleans(), settle_now=st.booleans())
    def answers_arrive(self, data, every, settle_now):
        pending = self.pending_answers()
        if pending and not every:
            pending = [data.draw(st.sampled_from(pending))]
        for r in pending:
            r.answer.set_result(None)
        self.then(settle_now)

    @rule(settle_now=st.booleans())
    def stream_ends(self, settle_now):
        if self.streams:
            self.streams -= 1
            self.room[0] += 1
            self.queue.notify(1)
        self.then(settle_now)

    @rule(settle_now=st.booleans())
    def registry_refresh(self, settle_now):
        self.queue.notify(1)
        self.then(settle_now)

    @rule(n=st.integers(1, 2), settle_now=st.booleans())
    def decode_worker_joins(self, n, settle_now):
        self.room[0] += n
        self.queue.notify_all()
        self.then(settle_now)

    @rule(data=st.data(), woken=st.booleans(), settle_now=st.booleans())
    def client_leaves(self, data, woken, settle_now):
        """Any request's client, or one whose request was just woken (before it runs)."""
        running = [(r, task) for r, task in self.requests if not task.done()]
        if woken:
            running = [(r, task) for r, task in running if r.place.queued and r.place._may_try]
        if running:
            data.draw(st.sampled_from(running))[1].cancel()
        self.then(settle_now)

    @rule(dt=st.sampled_from([1.0, 5.0, 10.0]), settle_now=st.booleans())
    def time_passes(self, dt, settle_now):
        self.loop.now += dt
        self.then(settle_now)

    @rule()
    def settle(self):
        self.run(settle())
        for r, task in self.requests:
            if task.done() and not task.cancelled():
                task.result()  # an assertion inside a request fails the test here
        self.settled = True

    @invariant()
    def the_queue_is_bounded(self):
        assert len(self.queue._places) <= self.queue.size

    @invariant()
    def no_wake_up_is_lost(self):
        if self.settled and self.room[0] > 0 and self.queue._waiting:
            assert self.pending_answers(), f"room for {self.room[0]} while {len(self.queue._waiting)} wait"

    def teardown(self):
        try:
            # Everyone ends: answers come, time runs out for the rest; then the queue is empty.
            for _ in range(64):
                for r in self.pending_answers():
                    r.answer.set_result(None)
                self.loop.now += 5.0
                self.run(settle())
                if all(task.done() for _, task in self.requests):
                    break
            for r, task in self.requests:
                assert task.done()
                if not task.cancelled():
                    task.result()
            assert not self.queue._places and not self.queue._waiting
        finally:
            self.loop.close()


TestQueueMachine = QueueMachine.TestCase
# Under mutation testing (mutmut sets MUTANT_UNDER_TEST) only whether the test fails counts: no shrinking.
_PHASES = tuple(p for p in Phase if p not in (Phase.shrink, Phase.explain)) if os.environ.get("MUTANT_UNDER_TEST") \
    else tuple(Phase)
TestQueueMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None, phases=_PHASES)


# ---- requests sent and not yet in a heartbeat ----------------------------------------------------


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
