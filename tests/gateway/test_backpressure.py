"""The gateway's wait queue (gateway/backpressure.py): bounded, deadlines, strictly first come first
served, no lost wake-up -- each rule of the module docstring pinned by an example, driven by hand
or by requests that try as the dispatcher does (tests/support/wait_queue_driver.py).  The same queue as a
state machine: tests/gateway/test_backpressure_machine.py."""
from __future__ import annotations

import asyncio

import pytest

from gateway.backpressure import ADMITTED_WAKES, KeyLineFull, Saturated, WaitQueue
from gateway.handlers import OpenAIHandlers
from gateway.openai_errors import OpenAIError
from tests.support.wait_queue_driver import Request, VirtualClockLoop, in_line, settle, start


async def test_requests_are_woken_oldest_first():
    queue, room = WaitQueue(size=3, timeout_s=60), [0]
    requests = await start(queue, room, 3)
    assert queue.places_held == 3
    assert [r.tries for r, _ in requests] == [1, 0, 0]  # only the first found the queue empty
    for expected in range(3):
        room[0] += 1
        queue.notify(1)
        await settle()
        assert [r.outcome == "admitted" for r, _ in requests] == [i <= expected for i in range(3)]
    assert queue.places_held == 0


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
    assert task_a.cancelled() and b.outcome == "admitted" and queue.places_held == 0


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
    assert queue.places_held == 0


async def test_a_cancelled_waiter_leaves_the_queue():
    queue, room = WaitQueue(size=1, timeout_s=60), [0]
    (_, task), = await start(queue, room, 1)
    task.cancel()
    await settle()
    assert queue.places_held == 0
    queue.notify(1)  # nothing to wake, nothing breaks


async def test_a_request_that_leaves_its_place_unwoken_wakes_nobody():
    queue = WaitQueue(size=3, timeout_s=60)
    (a, first), (b, second) = await in_line(queue, 2)
    first.cancel()  # its client left while it waited: it held no wake-up
    await settle()
    a.leave()
    await settle()
    assert not second.done() and queue.places_held == 1
    second.cancel()


# ---- each rule of a Place, driven by hand -------------------------------------------------------


async def test_turn_says_whether_the_request_waited_and_a_request_still_trying_never_waits():
    queue = WaitQueue(size=2, timeout_s=60)
    (a, first), = await in_line(queue, 1)
    queue.notify(1)
    await settle()
    assert first.result() is True  # it waited in line
    assert await a.turn() is False  # one worker said busy, it tries the next: no wait, no place lost
    assert queue.places_held == 1 and a.queued


async def test_a_request_that_gets_room_gives_its_place_up_at_once_and_queues_at_the_back_if_it_loses_it():
    queue = WaitQueue(size=3, timeout_s=60)
    (a, first), (b, second) = await in_line(queue, 2)
    queue.notify(1)
    await settle()
    assert first.done() and not second.done()
    a.admitted()  # its stream runs on; its place is free now
    assert queue.places_held == 1 and not a.queued
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


async def test_a_wake_up_passed_on_as_a_request_queues_is_not_passed_on_again_when_it_leaves():
    """A request that queued after an unheard notification passed that wake-up on once (to itself,
    the only one in line); admitted, it wakes the next ADMITTED_WAKES and leaving wakes nobody more."""
    queue = WaitQueue(size=5, timeout_s=60)
    a = queue.place()
    assert await a.turn() is False
    queue.notify(1)  # while A tries: nobody waits
    a.no_room("every decode worker is busy")
    assert await a.turn() is True  # it queued and passed the wake-up on: to itself
    waiting = await in_line(queue, ADMITTED_WAKES + 1)
    a.admitted()
    a.leave()
    await settle()
    assert [task.done() for _, task in waiting] == [True] * ADMITTED_WAKES + [False]
    waiting[-1][1].cancel()


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
    for size, timeout, per_key in ((-1, 1, None), (1, 0, None), (1, 1, 0)):
        with pytest.raises(ValueError, match="queue size must be >= 0, timeout > 0 and a per-key limit >= 1 or none"):
            WaitQueue(size, timeout, per_key)



# ---- many in line, room for many: the line drains in round trips that double --------------------


def held(requests) -> list[int]:
    """Which requests (by arrival) have a try whose answer the test holds."""
    return [i for i, (r, _) in enumerate(requests) if r.answer is not None and not r.answer.done()]


async def answer_all(requests) -> None:
    for i in held(requests):
        requests[i][0].answer.set_result(None)
    await settle()


async def test_tries_in_flight_double_while_room_lasts_and_stop_at_the_first_busy_answers():
    """Fifteen wait, then room appears for three: the oldest tries; admitted, it wakes the next two,
    who, admitted, wake four -- tries in flight grow while answers are held instead of one at a time
    for the whole gateway (256 in line at one decode round trip each outlasted the queue timeout
    while workers had room) -- and each busy answer ends its branch: nobody behind them tries."""
    queue, room = WaitQueue(size=16, timeout_s=60), [0]
    requests = await start(queue, room, 15)
    for r, _ in requests:
        r.hold = True
    room[0] = 3
    queue.notify(1)
    await settle()
    assert held(requests) == [0]
    await answer_all(requests)  # admitted: it wakes two
    assert held(requests) == [1, 2]
    await answer_all(requests)  # both admitted: four try (no room is left, though they cannot know)
    assert held(requests) == [3, 4, 5, 6]
    await answer_all(requests)  # four busy answers: they wait again, at their places, and wake nobody
    assert held(requests) == [] and [r.outcome for r, _ in requests[:3]] == ["admitted"] * 3
    assert [r.tries for r, _ in requests[3:]] == [1, 1, 1, 1] + [0] * 8
    assert queue.places_held == 12
    room[0] = 1
    queue.notify(1)  # the next room goes to the oldest of them
    await settle()
    assert held(requests) == [3]
    for _, task in requests:
        task.cancel()


# ---- a request admitted, then back in line --------------------------------------------------------


def on_virtual_clock(scenario) -> None:
    loop = VirtualClockLoop()
    try:
        loop.run_until_complete(scenario(loop))
    finally:
        loop.close()


def test_a_request_admitted_then_back_in_line_waits_a_full_timeout_again():
    """A request waited 9.9 s of its 10, was admitted, and lost its decode worker before the first
    token while every other one was busy: its new wait has a deadline of its own (the old one made
    it a 503 at once)."""
    async def scenario(loop: VirtualClockLoop) -> None:
        queue = WaitQueue(size=2, timeout_s=10)
        (a, first), = await in_line(queue, 1)
        loop.now = 9.9
        queue.notify(1)
        await settle()
        assert first.result() is True
        a.admitted()
        loop.now = 10.5  # its worker fails after the old deadline
        assert await a.turn() is False  # it tries again at once ...
        a.no_room("every decode worker is busy")  # ... and finds no room: it queues again
        again = asyncio.create_task(a.turn())
        await settle()
        loop.now = 20.4
        await settle()
        assert not again.done()
        loop.now = 20.5
        await settle()
        with pytest.raises(Saturated, match="within 10 s"):
            again.result()

    on_virtual_clock(scenario)


# ---- one API key's share of the line -----------------------------------------------------------


async def test_one_api_key_holds_at_most_its_share_of_the_places_in_line():
    queue = WaitQueue(size=4, timeout_s=60, per_key=2)
    a = await in_line(queue, 2, key="key-a")
    with pytest.raises(KeyLineFull, match=r"this API key \(key-a\) already has 2 requests waiting") as info:
        await queue.place("key-a").turn()
    assert info.value.status == 429 and info.value.retry_after == 30.0
    b = await in_line(queue, 2, key="key-b")  # another key still finds its places
    with pytest.raises(Saturated, match="4 requests are already waiting") as info:
        await queue.place("key-c").turn()
    assert info.value.status == 503 and not isinstance(info.value, KeyLineFull)
    (first, waiting), (second, woken) = a
    waiting.cancel()  # a client of key-a goes away: its place is free for key-a again ...
    await settle()
    first.leave()
    queue.notify(1)  # ... and so is the place of a request that got room
    await settle()
    assert woken.done()
    second.admitted()
    again = await in_line(queue, 2, key="key-a")
    for place, task in again + b:
        task.cancel()
        await settle()
        place.leave()
    assert queue.places_held == 0 and not queue._by_key


async def test_a_requests_choices_count_once_in_line_and_in_its_keys_share():
    """An n=3 request's choices each wait for room, as one request: it took 3 of the places, and
    its key's share -- so its third choice got a 429 in the middle of its stream."""
    queue = WaitQueue(size=2, timeout_s=60, per_key=1)
    choices = await in_line(queue, 3, key="key-a", request="cmpl-1")
    assert queue.places_held == 1 and queue._by_key == {"key-a": 1}
    with pytest.raises(KeyLineFull):  # the key's share: the one request
        await queue.place("key-a", "cmpl-2").turn()
    other = await in_line(queue, 1, key="key-b", request="cmpl-3")
    with pytest.raises(Saturated, match="2 requests are already waiting"):
        await queue.place("key-c", "cmpl-4").turn()
    for place, task in [*choices[::-1], *other]:  # (whichever choice leaves last)
        task.cancel()
        await settle()
        place.leave()
        assert queue.places_held == (2 if place in (p for p, _ in choices[1:]) else
                                     1 if place is choices[0][0] else 0)
    assert not queue._by_key and not queue._groups


async def test_without_a_per_key_limit_or_a_key_any_request_may_take_every_place():
    for queue, key in ((WaitQueue(size=3, timeout_s=60), "key-a"), (WaitQueue(size=3, timeout_s=60, per_key=1), None)):
        line = await in_line(queue, 3, key=key)
        assert queue.places_held == 3
        for place, task in line:
            task.cancel()
            await settle()
            place.leave()


async def test_a_key_over_its_share_of_the_line_is_told_429_with_retry_after():
    with pytest.raises(OpenAIError) as info:
        await OpenAIHandlers._upstream(refuse(KeyLineFull("its share of the wait queue", retry_after=5.0)))
    assert info.value.status == 429 and info.value.retry_after == 5.0 and info.value.code == "rate_limit_exceeded"
    assert "its share of the wait queue" in info.value.message
    with pytest.raises(OpenAIError) as info:
        await OpenAIHandlers._upstream(refuse(Saturated("every decode worker is busy", retry_after=5.0)))
    assert info.value.status == 503 and info.value.message.startswith("The server is saturated")


async def refuse(exc: Exception):
    raise exc
