"""Driving ``gateway.backpressure.WaitQueue`` in tests: requests that try for room as the dispatcher
does, requests put in line by hand, and an event loop whose clock moves only when the test says so."""
from __future__ import annotations

import asyncio

from gateway.backpressure import Place, Saturated, WaitQueue


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


async def in_line(queue: WaitQueue, n: int, key: str | None = None,
                  request: str | None = None) -> list[tuple[Place, asyncio.Task]]:
    """``n`` requests (of API key ``key``; ``request``: choices of that one request) waiting in
    line, oldest first (the first found the line empty and tried)."""
    out = []
    for _ in range(n):
        place = queue.place(key, request)
        if not queue._places:
            assert await place.turn() is False  # a newcomer facing an empty line tries at once
            place.no_room("every decode worker is busy")
        out.append((place, asyncio.create_task(place.turn())))
        await settle()
        assert not out[-1][1].done()
    return out


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only when the test advances it."""

    def __init__(self):
        super().__init__()
        self.now = 0.0

    def time(self) -> float:
        return self.now
