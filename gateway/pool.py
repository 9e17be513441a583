"""The gateway's view of the worker pools: the registry, refreshed in the background.

Redis down: the last known list is kept (routing by the last known load goes on) and a warning
and a metric say so.  A worker that fails a request is benched locally for a few seconds, so the
gateway stops sending it traffic before its heartbeat lapses.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Sequence

from redis.exceptions import RedisError

from common.cluster.aio import cancel_and_wait
from common.cluster.redis_util import UNAVAILABLE_ERRORS
from common.cluster.registry import WorkerInfo, WorkerRegistry

log = logging.getLogger(__name__)


class WorkerPool:
    """Live workers of one model, as last read from the registry."""

    def __init__(self, registry: WorkerRegistry, model: str, refresh_s: float = 0.5, bench_s: float = 5.0,
                 on_redis_error: Callable[[], None] | None = None):
        self.registry = registry
        self.model = model
        self.refresh_s = refresh_s
        self.bench_s = bench_s
        self.on_redis_error = on_redis_error
        self.workers: list[WorkerInfo] = []
        self.redis_ok = True
        self._benched: dict[str, float] = {}
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._changed = asyncio.Event()
        self._reading: asyncio.Future | None = None  # the registry read in progress (``refresh``)
        self._next_reading: asyncio.Future | None = None  # the one to follow it, for who called since
        # Called after every refresh, read or not, with (previous, current) listings.
        self.listeners: list[Callable[[Sequence[WorkerInfo], Sequence[WorkerInfo]], None]] = []

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._run(), name="worker-pool-refresh")

    async def stop(self) -> None:
        # A flag as well as cancel(): on Python 3.11 a cancel landing inside a redis-py call can be lost.
        self._stopping = True
        await cancel_and_wait(self._task)
        for reading in (self._next_reading, self._reading):
            if reading is not None and not reading.done():
                await cancel_and_wait(reading)

    async def _run(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception:  # a bug must not end the refreshes: the pool would freeze as it is
                log.exception("worker pool refresh failed")

    async def refresh(self) -> None:
        """Read the registry; every listener hears of it, read or not (Redis down: the same list --
        a tick still, on which a benched worker may be back).  Redis refusing the read (MISCONF,
        READONLY, an ACL) counts as Redis unavailable.  Callers at once share one read (a drain's
        hand-overs each ask for one), and one begun after they called (what changed before their call
        is in it): a read in progress is followed by one more, which all who called meanwhile share;
        no read's older list lands after a newer one."""
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read())
            await asyncio.shield(self._reading)
            return
        if self._next_reading is None:
            self._next_reading = asyncio.ensure_future(self._read_after(self._reading))
        await asyncio.shield(self._next_reading)

    async def _read_after(self, current: asyncio.Future) -> None:
        await asyncio.wait((current,))
        self._next_reading = None
        self._reading = asyncio.ensure_future(self._read())
        await self._reading

    async def _read(self) -> None:
        previous = self.workers
        try:
            self.workers = await self.registry.list_workers(self.model)
        except (*UNAVAILABLE_ERRORS, RedisError) as exc:
            if self.redis_ok:
                log.warning("Redis unavailable (%s): routing on the last known pool of %d workers",
                            exc, len(self.workers))
            self.redis_ok = False
            if self.on_redis_error:
                self.on_redis_error()
            for listener in self.listeners:
                listener(previous, self.workers)
            return
        if not self.redis_ok:
            log.warning("Redis is back: pool has %d workers", len(self.workers))
        self.redis_ok = True
        self._changed.set()
        self._changed = asyncio.Event()
        for listener in self.listeners:
            listener(previous, self.workers)

    def bench(self, worker_id: str) -> None:
        """Keep a worker that just failed out of routing for ``bench_s``."""
        self._benched[worker_id] = time.monotonic() + self.bench_s

    def routable(self, exclude: set[str] = frozenset()) -> list[WorkerInfo]:
        """The workers listed and not benched, but those ``exclude`` names: by id, or by run (its
        ``audience``: the worker's restart is not excluded)."""
        now = time.monotonic()
        return [w for w in self.workers if w.worker_id not in exclude and w.audience not in exclude
                and self._benched.get(w.worker_id, 0.0) <= now]

    def decoding_runs(self, runs: set[str]) -> set[str]:
        """Those of ``runs`` (``WorkerInfo.audience``) that are routable decode workers now."""
        return {w.audience for w in self.routable() if w.audience in runs and can_decode(w)}

    def why_no_decode_worker(self) -> str:
        """Why no decode worker could be routed to, for a refusal: every one drains (or is drained),
        or none is available (none registered, all benched or failed for the request)."""
        decoders = [w for w in self.workers if w.role in ("decode", "both")]
        drained = sum(w.state in ("draining", "idle") for w in decoders)
        if decoders and drained == len(decoders):
            return f"every decode worker ({drained}) is draining or drained"
        return "no decode worker is available"

    async def wait_for_change(self, timeout: float) -> None:
        """Wait for the next refresh (e.g. while the pool is empty)."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass


def can_decode(w: WorkerInfo) -> bool:
    """An active worker in a decode role (decode, or both)."""
    return w.state == "active" and w.role in ("decode", "both")
