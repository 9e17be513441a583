"""The gateway's wait queue as a state machine (hypothesis) on an event loop whose clock moves only
when the test says so: requests arrive, try for room and get their answers late, streams end, the
registry refresh probes, decode workers join, clients leave, time passes.  Invariants: the queue is
bounded, no request tries while an older one waits, no wake-up is lost."""
from __future__ import annotations

import asyncio
import os

import pytest
from hypothesis import Phase, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gateway.backpressure import Saturated, WaitQueue
from tests.support.wait_queue_driver import Request, VirtualClockLoop, settle

pytestmark = pytest.mark.slow(seconds=13)  # a long file: scheduled by its length (tests/conftest.py)


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
