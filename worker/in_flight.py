"""The requests a worker has in flight: one handler task each, by request id.

A request is tracked from its handler's start until everything it held is released -- for a
handler that ends with a KV transfer still settling, until that transfer settled and the engine
freed its blocks (``finish``) -- so "nothing in flight" means the worker holds nothing for anyone.
Draining and shutdown wait on that (``wait_idle``); an abort or an ended lease cancels the handler.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from worker.engine_thread import EngineFailed, EngineThread


class InFlight:
    """Request id -> its handler task, with an event set while none is in flight."""

    def __init__(self, engine: Callable[[], EngineThread], spawn: Callable[[Awaitable], asyncio.Task]):
        self._engine = engine  # the worker's engine thread, which exists once a request can arrive
        self._spawn = spawn
        self._tasks: dict[str, asyncio.Task] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    def __len__(self) -> int:
        return len(self._tasks)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tasks

    def track(self, request_id: str) -> None:
        """The current task handles ``request_id`` from now on; ValueError if one already does."""
        if request_id in self._tasks:
            raise ValueError(f"request_id {request_id!r} is already in flight on this worker")
        self._tasks[request_id] = asyncio.current_task()
        self._idle.clear()

    def untrack(self, request_id: str) -> None:
        """Forget a request that holds nothing on this worker (refused before it got anything)."""
        self._tasks.pop(request_id, None)
        if not self._tasks:
            self._idle.set()

    def finish(self, request_id: str, engine_cleanup, then=None, wait_for: asyncio.Future | None = None) -> None:
        """End a request's handler: wait for ``wait_for`` (e.g. an abandoned KV transfer settling),
        run ``engine_cleanup(engine)`` in the engine thread, then the ``then`` coroutine, then
        forget the request.  Runs as its own task so a handler cancelled mid-cleanup (the peer
        hung up) still frees everything."""
        async def cleanup() -> None:
            try:
                if wait_for is not None:
                    await asyncio.wait([wait_for])
                try:
                    await self._engine().call(engine_cleanup)
                except EngineFailed:
                    pass  # nothing runs any more; the process exits
                if then is not None:
                    await then
            finally:
                self.untrack(request_id)

        self._spawn(cleanup())

    def cancel(self, request_id: str) -> bool:
        """Cancel ``request_id``'s handler (which frees its blocks and tells its peers); False if
        it is not here."""
        task = self._tasks.get(request_id)
        if task is None:
            return False
        task.cancel()
        return True

    def cancel_all(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()

    async def wait_idle(self, timeout: float | None = None) -> None:
        """Until nothing is in flight, at most ``timeout`` seconds (None: no bound)."""
        if self._tasks:
            idle = asyncio.ensure_future(self._idle.wait())
            try:
                await asyncio.wait([idle], timeout=timeout)
            finally:
                idle.cancel()
