"""Holding requests while every decode worker is busy: a bounded, first-come-first-served queue.

    request --turn()--> route --> D1: busy --> D2: busy --> no_room()
        --turn()--> (queued: a place in line, kept until the request leaves) ... woken ...
        --> route again --> D3: a stream --> admitted() (the place goes, the next two in line are woken)
        --> queue full, or deadline passed: Saturated (the client gets 503 + Retry-After)
        --> its API key holds its share of the places: KeyLineFull (429 + Retry-After)

Each request holds one ``Place``.  Its rules, which make the queue strictly first come, first
served:

* A request that finds the queue empty tries at once; one that finds anybody in it (waiting or
  trying) queues behind them -- a newcomer never overtakes a waiting request.
* A request that found no room queues with a deadline (``timeout_s`` from then) and keeps its
  place, in order of arrival, until it leaves or a decode worker takes it: woken and trying, it
  still counts against ``size`` and stays ahead of everyone who came later; finding no room again,
  it waits again at the same place.  So a long prompt that needs more room than short ones is not
  sent to the back each time (decode workers keep the room it needs for it: ``Scheduler.claim``).
  A request taken, whose worker then fails before the first token and which finds no room, queues
  again at the back, with a deadline of its own.
* Room may appear when one of this gateway's streams ends (``notify(1)``: one slot freed), when
  the registry refresh brings new loads (``notify(1)``: a probe, since other gateways' streams
  end too), or when a decode worker joins (``notify_all``).  A notification wakes the oldest
  waiting requests; a woken request that finds an older one back in line hands its turn to it.
* No wake-up is lost: one that lands on a request that then leaves without using it (its client
  went away, its deadline passed, its request failed) is passed on to the oldest waiting; one
  that finds nobody waiting while requests are trying is passed on when such a try ends without
  room (the room may have appeared after a worker said busy).
* Room found is passed on, doubled: a request that leaves its place because it got room wakes the
  next ``ADMITTED_WAKES`` (2) in line (more room may be free).  While room lasts the tries in
  flight double every round trip to a decode worker, so a long line drains in a few round trips
  rather than one request per round trip for the whole gateway (256 in line at ~50 ms each
  outlasted the queue timeout while workers had room); each busy answer ends its branch.
* One API key holds at most ``per_key`` places (None: no limit): no one key fills the line.

So no request starts a try while a request that queued before it waits.  Requests woken together
try concurrently: the queue orders who may try, the workers' answers decide who gets the room.
"""
from __future__ import annotations

import asyncio
import bisect
import itertools


ADMITTED_WAKES = 2  # wake-ups a request that got room passes on (see the module docstring)


class Saturated(Exception):
    """No worker can take the request now (the client gets ``status``, 503, with Retry-After)."""

    status = 503

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class KeyLineFull(Saturated):
    """The request's API key already holds its share of the places in line (429 with Retry-After:
    the key's own limit, as for its requests in flight)."""

    status = 429


class WaitQueue:
    """At most ``size`` requests hold a place at once, at most ``per_key`` of them for one key
    (None: no such limit), each until its deadline (``timeout_s`` after it queued); ``size == 0``
    disables waiting."""

    def __init__(self, size: int, timeout_s: float, per_key: int | None = None):
        if size < 0 or timeout_s <= 0 or (per_key is not None and per_key < 1):
            raise ValueError(f"queue size must be >= 0, timeout > 0 and a per-key limit >= 1 or none, "
                             f"got {size}, {timeout_s}, {per_key}")
        self.size = size
        self.timeout_s = timeout_s
        self.per_key = per_key
        self._places: dict[Place, None] = {}  # every place held (waiting or trying), in arrival order
        # A request's choices (``n``, a batch's prompts) hold a place each but count as one request:
        # against ``size`` and ``per_key`` alike (an n=32 request took 32 of the places, and its
        # key's share: a 429 in the middle of its stream).
        self._groups: dict[str, int] = {}  # places held per request
        self._requests = 0  # requests holding places
        self._by_key: dict[str, int] = {}  # requests holding places, per key
        self._waiting: list[tuple[int, Place]] = []  # (ticket, place) of those waiting to be woken, sorted
        self._tickets = itertools.count()
        # Notifications that found nobody waiting; a request whose try spans one tries again.
        self._missed = 0

    @property
    def places_held(self) -> int:
        """Requests holding a place (waiting to be woken, or woken and trying), each once."""
        return self._requests

    def place(self, key: str | None = None, request: str | None = None) -> "Place":
        """A request's place in line (``key``: its API key's id, for ``per_key``; ``request``: what
        names the request its choices belong to, which count once); call ``leave()`` when the
        request ends, on every path."""
        return Place(self, key, request)

    def notify(self, n: int) -> None:
        """Room for ``n`` more may have appeared: wake the ``n`` oldest waiting requests (one that
        finds nobody is kept for the requests trying now)."""
        if self._wake_oldest(n) < n:
            self._missed += 1

    def _wake_oldest(self, n: int) -> int:
        """Wake up to ``n`` of the oldest waiting requests; how many were woken."""
        woken = 0
        while woken < n and self._waiting:
            self._waiting.pop(0)[1]._wake()
            woken += 1
        return woken

    def notify_all(self) -> None:
        """Room for many may have appeared (a decode worker joined): wake every waiting request."""
        self.notify(len(self._waiting) + 1)

    def deadline(self) -> float:
        """The deadline of a request that queues now, on the event loop's clock."""
        return asyncio.get_running_loop().time() + self.timeout_s


class Place:
    """One request's place in a ``WaitQueue`` (see the module docstring).

    ``await turn()`` before each attempt to route: it returns at once while the request may try
    (a newcomer facing an empty queue, a request retrying after one worker said busy or failed),
    and otherwise queues it and waits until it is woken; it raises ``Saturated`` when the queue is
    full or the deadline passes (``KeyLineFull`` when its key holds its share of the places).  Then
    ``no_room(why)`` when no decode worker has room (the next ``turn()`` waits), ``admitted()`` when
    one took the request, and ``leave()`` at the end.
    """

    def __init__(self, queue: WaitQueue, key: str | None = None, request: str | None = None):
        self._queue = queue
        self.key = key
        self.request = request
        self.ticket: int | None = None  # the order of its arrival in line; None: not queued
        self.deadline: float | None = None  # set when it queues, cleared when it is admitted
        self.why = "no decode worker has room"  # until a try of its own says why
        self._fresh = True  # has not been told no_room yet
        self._may_try = False  # woken (or never queued) and not yet told no_room
        self._retry = False  # a notification nobody heard came during its try: pass it on as it queues
        self._missed_at_try = 0
        self._woken: asyncio.Future | None = None
        self._listed = False  # in the queue's list of those waiting to be woken
        self._left = False

    @property
    def queued(self) -> bool:
        return self.ticket is not None

    async def turn(self) -> bool:
        """Return when the request may try to route; True when it waited in line first."""
        queue = self._queue
        if self._left:
            raise RuntimeError("turn() after leave()")
        if self._may_try:  # still trying (after a busy answer, a failure): no wait
            return False
        if self._fresh and not queue._places:  # a newcomer, nobody in line: it tries at once
            self._start_try()
            return False
        if self.ticket is None:
            self._join()
        while True:
            await self._wait()
            head = queue._waiting[0] if queue._waiting else None
            if head is None or head[0] > self.ticket:
                break
            # An older request went back in line after this one was woken: the turn is its.
            self._may_try = False
            queue._waiting.pop(0)[1]._wake()
        self._start_try()
        return True

    def no_room(self, why: str) -> None:
        """This try found no decode worker with room (``why``: for the 503's message)."""
        self.why = why
        self._fresh = self._may_try = False
        self._retry = self._queue._missed != self._missed_at_try

    def admitted(self) -> None:
        """A decode worker took the request: its place goes, and the next ``ADMITTED_WAKES`` in line
        are woken (more room may be free).  A later failure retries at once and, finding no room,
        queues at the back with a new deadline."""
        self.deadline = None
        if self.ticket is not None:
            self._release()
            # A guess that more room is free, not news of room freed (which notify() brings): with
            # nobody waiting it is dropped, not kept for the requests trying now.
            self._queue._wake_oldest(ADMITTED_WAKES)

    def leave(self) -> None:
        """The request ends (served, failed, timed out, or its client went away).  A wake-up it
        holds unused is passed on.  Idempotent."""
        if self._left:
            return
        self._left = True
        pass_on = self._retry or (self.ticket is not None and self._may_try)
        if self.ticket is not None:
            self._release()
        if pass_on:
            self._queue.notify(1)

    # ---- internals ---------------------------------------------------------------------------

    def _start_try(self) -> None:
        self._may_try = True
        self._missed_at_try = self._queue._missed

    def _join(self) -> None:
        queue = self._queue
        retry_after = max(1.0, queue.timeout_s / 2)
        counted = self.request is not None and queue._groups.get(self.request, 0) > 0  # its request holds one
        mine = queue._by_key.get(self.key, 0) if self.key is not None else 0
        if not counted and queue._requests >= queue.size:
            raise Saturated(f"{self.why}, and {queue._requests} requests are already waiting; retry shortly",
                            retry_after=retry_after)
        if not counted and queue.per_key is not None and mine >= queue.per_key:
            raise KeyLineFull(f"{self.why}, and this API key ({self.key}) already has {mine} requests waiting, "
                              f"its share of the wait queue; retry shortly", retry_after=retry_after)
        if self.deadline is None:
            self.deadline = queue.deadline()
        self.ticket = next(queue._tickets)
        queue._places[self] = None
        if self.request is not None:
            queue._groups[self.request] = queue._groups.get(self.request, 0) + 1
        if not counted:
            queue._requests += 1
            if self.key is not None:
                queue._by_key[self.key] = mine + 1

    def _release(self) -> None:
        queue = self._queue
        self._unlist()
        del queue._places[self]
        self.ticket = None
        if self.request is not None:
            others = queue._groups.pop(self.request) - 1
            if others:  # its request holds places still: it counts on
                queue._groups[self.request] = others
                return
        queue._requests -= 1
        if self.key is not None:
            left = queue._by_key[self.key] - 1
            if left:
                queue._by_key[self.key] = left
            else:
                del queue._by_key[self.key]

    def _wake(self) -> None:
        """Called by the queue, which has taken it off ``_waiting``."""
        self._listed = False
        self._may_try = True
        if self._woken is not None and not self._woken.done():
            self._woken.set_result(None)

    def _unlist(self) -> None:
        if self._listed:
            self._queue._waiting.remove((self.ticket, self))
            self._listed = False

    async def _wait(self) -> None:
        queue = self._queue
        loop = asyncio.get_running_loop()
        if loop.time() >= self.deadline:
            raise Saturated(f"{self.why} within {queue.timeout_s:g} s; retry shortly")
        self._woken = loop.create_future()
        bisect.insort(queue._waiting, (self.ticket, self))
        self._listed = True
        if self._retry:  # a notification nobody heard came during its try: the oldest in line tries
            self._retry = False
            queue.notify(1)
        try:
            async with asyncio.timeout_at(self.deadline):
                await self._woken
        except TimeoutError:
            raise Saturated(f"{self.why} within {queue.timeout_s:g} s; retry shortly") from None
        finally:
            self._unlist()  # cancelled or timed out while waiting: out of the list
