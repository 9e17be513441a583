"""The prefix-cache index in Redis: which worker holds which prefix blocks.

A block hash (``common.engine.kv.prefix_hash``) names its whole prefix, so a worker holds the first ``n``
blocks of a prompt exactly when the first ``n`` hashes are in its set::

    {prefix}:{model}:blocks:{worker_id}  = SET{ h0, h1, h2, ... }      (32-byte hashes, PX = TTL)
    prompt hashes                          h0  h1  h2  h7  ...
    SMISMEMBER                             1   1   1   0   1           -> 3 leading blocks

Worker side, ``PrefixIndexPublisher``: the engine calls ``publish``/``remove`` (synchronous, cheap,
thread-safe, never blocking on Redis); a background task flushes them in pipelined batches and
keeps the set's TTL fresh.  The publisher mirrors the engine's cached set, so whenever Redis may
have missed something (Redis was down, the bounded queue overflowed, the set vanished because Redis
restarted or the TTL ran out) it replaces the whole set in one MULTI/EXEC.

On clean shutdown stop the publisher (``stop(delete=True)``) before deregistering the worker, or
a last flush could re-create the set after the registry deleted it.

Gateway side, ``PrefixIndexReader.longest_prefix``: one pipelined round trip of SMISMEMBER per
worker.  The index is a hint: if Redis is unreachable it returns ``{}`` and routing falls back to load.
A lookup costs at most ``timeout_s``; after a failure a circuit breaker skips Redis (``{}`` at once)
and lets one lookup through every ``retry_interval_s`` to probe it, until one succeeds::

    closed --lookup fails or times out--> open: skip --retry_interval_s--> one probe --ok--> closed
                                                ^------------------------------ fails --'
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Callable, Iterable, Sequence

import redis.asyncio as aioredis

from common.cluster.aio import cancel_and_wait
from common.cluster.redis_keys import DEFAULT_KEY_PREFIX, RedisKeys
from common.cluster.redis_util import UNAVAILABLE_ERRORS
from common.engine.kv.prefix_hash import HASH_LEN

log = logging.getLogger(__name__)

CHUNK = 4096  # members per SADD/SREM/SMISMEMBER command inside a pipeline


def _check_hash(h: object) -> bytes:
    if not isinstance(h, bytes) or len(h) != HASH_LEN:
        raise ValueError(f"block hash must be {HASH_LEN} bytes, got {type(h).__name__} {h!r:.40}")
    return h


def _chunks(items: Sequence[bytes], n: int = CHUNK) -> Iterable[Sequence[bytes]]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


class PrefixIndexPublisher:
    """Publishes one worker's cached prefix blocks to Redis.

    ``publish(hashes)`` when blocks are committed (full and hashed), ``remove(hashes)`` when they
    are evicted.  Calls are counted per hash, so two cached blocks with the same hash stay
    published until both are evicted.  Updates are coalesced per hash and flushed by a background
    task (``start()``), or on demand with ``await flush()``.

    Redis trouble never reaches the caller: a failed flush drops its batch, counts it in
    ``dropped_updates``, and marks the set for a full resync, retried every ``retry_interval_s``.
    More than ``max_pending`` unflushed hashes also drops them and resyncs instead.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        model: str,
        worker_id: str,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        ttl_s: float = 5.0,
        max_pending: int = 100_000,
        retry_interval_s: float = 1.0,
    ) -> None:
        if not 0 < ttl_s <= 3600:
            raise ValueError(f"ttl_s must be in (0, 3600], got {ttl_s}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        if retry_interval_s <= 0:
            raise ValueError(f"retry_interval_s must be > 0, got {retry_interval_s}")
        self.client = client
        self.key = RedisKeys(key_prefix, model).blocks(worker_id)
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.keepalive_s = ttl_s / 3
        self.max_pending = max_pending
        self.retry_interval_s = retry_interval_s
        # Counters (read by metrics): updates lost to Redis errors/overflow, failed flushes, resyncs.
        self.dropped_updates = 0
        self.flush_failures = 0
        self.resyncs = 0

        self._lock = threading.Lock()  # guards _counts/_pending/_needs_resync (engine may be another thread)
        self._counts: dict[bytes, int] = {}  # the engine's truth: hash -> number of cached blocks
        self._pending: dict[bytes, bool] = {}  # hash -> present? changes not yet in Redis
        self._needs_resync = True  # a previous incarnation of this worker may have left a stale set
        self._healthy = True
        self._last_ok = 0.0
        self._flush_lock = asyncio.Lock()  # flushes must not interleave or adds/removes reorder
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False

    # ---- engine side (synchronous, any thread) ------------------------------------------------

    def publish(self, hashes: Iterable[bytes]) -> None:
        """Record newly cached blocks."""
        self._update(hashes, +1)

    def remove(self, hashes: Iterable[bytes]) -> None:
        """Record evicted blocks (a hash that was never published is ignored)."""
        self._update(hashes, -1)

    def _update(self, hashes: Iterable[bytes], delta: int) -> None:
        hashes = [_check_hash(h) for h in hashes]
        with self._lock:
            was_idle = not self._pending
            overflow = False
            for h in hashes:
                old = self._counts.get(h, 0)
                new = max(0, old + delta)
                if new:
                    self._counts[h] = new
                else:
                    self._counts.pop(h, None)
                if (old == 0) != (new == 0) and not self._needs_resync:
                    self._pending[h] = new > 0
            if len(self._pending) > self.max_pending:
                self.dropped_updates += len(self._pending)
                self._pending.clear()
                self._needs_resync = overflow = True
        if overflow or (was_idle and self._pending):
            self._wakeup()

    def _wakeup(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            loop.call_soon_threadsafe(wake.set)

    @property
    def num_cached(self) -> int:
        return len(self._counts)

    @property
    def healthy(self) -> bool:
        """False after a failed flush, until one succeeds."""
        return self._healthy

    # ---- background flushing ------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("publisher already started")
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name=f"prefix-index-publisher:{self.key}")

    async def stop(self, *, delete: bool = True) -> None:
        """Stop flushing; with ``delete`` also remove the set (clean shutdown, best effort)."""
        task, self._task = self._task, None
        self._stopping = True
        await cancel_and_wait(task)
        if delete:
            try:
                await self.client.delete(self.key)
            except UNAVAILABLE_ERRORS as exc:
                log.warning("could not delete %s on stop (it will expire): %s", self.key, exc)

    async def _run(self) -> None:
        assert self._wake is not None, "_run() before start()"
        # The flag, not only cancel(): on Python 3.11 a cancel that lands as a redis-py socket
        # wait_for completes is lost (CPython gh-86296), and the loop would run on.
        while not self._stopping:
            await self.flush()
            if not self._healthy:
                # Back off; updates meanwhile only change the mirror that the resync will carry.
                await asyncio.sleep(self.retry_interval_s)
                continue
            timeout = max(0.0, self._last_ok + self.keepalive_s - time.monotonic())
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    async def flush(self) -> bool:
        """Push pending changes (or a full resync) and refresh the TTL now.

        Returns True when Redis holds exactly this worker's cached set afterwards.
        """
        async with self._flush_lock:
            try:
                await self._flush_once()
            except Exception as exc:  # the engine never sees Redis errors
                self.flush_failures += 1
                with self._lock:
                    self._needs_resync = True
                if self._healthy:
                    if isinstance(exc, UNAVAILABLE_ERRORS):
                        log.warning("prefix index: Redis unreachable, dropping updates until it "
                                    "returns (%s)", exc)
                    else:
                        log.exception("prefix index: flush failed; will resync")
                self._healthy = False
                return False
            if not self._healthy:
                log.info("prefix index: Redis reachable again; republished %d blocks", self.num_cached)
            self._healthy = True
            self._last_ok = time.monotonic()
            with self._lock:
                return not self._pending and not self._needs_resync

    async def _flush_once(self) -> None:
        with self._lock:
            resync = self._needs_resync
            if resync:
                snapshot = list(self._counts)
                self._pending.clear()
                self._needs_resync = False
            else:
                batch, self._pending = self._pending, {}
                expected = len(self._counts)
        try:
            if resync:
                await self._replace_all(snapshot)
                self.resyncs += 1
                return
            adds = [h for h, present in batch.items() if present]
            removes = [h for h, present in batch.items() if not present]
            async with self.client.pipeline(transaction=False) as pipe:
                for chunk in _chunks(removes):
                    pipe.srem(self.key, *chunk)
                for chunk in _chunks(adds):
                    pipe.sadd(self.key, *chunk)
                pipe.pexpire(self.key, self.ttl_ms)
                pipe.scard(self.key)
                results = await pipe.execute()
        except BaseException:
            with self._lock:
                if not resync:
                    self.dropped_updates += len(batch)
                self._needs_resync = True
            raise
        if results[-1] != expected:
            # The set is not what we built: Redis restarted empty, the TTL ran out, or someone
            # deleted it.  Replace it now rather than leave the gateway a partial picture.
            with self._lock:
                self._needs_resync = True
            log.info("prefix index: %s holds %d hashes, expected %d; resyncing", self.key, results[-1], expected)
            await self._flush_once()

    async def _replace_all(self, snapshot: list[bytes]) -> None:
        # MULTI/EXEC: readers see the old set or the new one, never a half-built one.
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(self.key)
            for chunk in _chunks(snapshot):
                pipe.sadd(self.key, *chunk)
            pipe.pexpire(self.key, self.ttl_ms)
            await pipe.execute()


class PrefixIndexReader:
    """Gateway side: how many leading prompt blocks each worker holds, in one round trip.

    Never raises for Redis trouble: an unreachable or slow Redis (``timeout_s``) yields ``{}``,
    sets ``available`` to False, bumps ``unavailable_total`` and calls ``on_unavailable`` (e.g. a
    metrics counter).  While unavailable, lookups skip Redis (``skipped_total``) except one probe
    per ``retry_interval_s`` (see the module docstring).  ``clock`` is for tests.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        timeout_s: float = 0.5,
        retry_interval_s: float = 2.0,
        on_unavailable: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if retry_interval_s <= 0:
            raise ValueError(f"retry_interval_s must be > 0, got {retry_interval_s}")
        RedisKeys(key_prefix, "probe")  # validate the prefix up front
        self.client = client
        self.key_prefix = key_prefix
        self.timeout_s = timeout_s
        self.retry_interval_s = retry_interval_s
        self.on_unavailable = on_unavailable
        self.clock = clock
        self.available = True
        self.unavailable_total = 0
        self.skipped_total = 0
        self._retry_at = 0.0  # while unavailable: no lookup reaches Redis before this
        self._probing = False

    async def longest_prefix(
        self, model: str, hashes: Sequence[bytes], worker_ids: Iterable[str]
    ) -> dict[str, int]:
        """``{worker_id: number of leading hashes cached}`` for every worker asked (0 if none).

        ``hashes`` are the prompt's chained block hashes in order; a worker's count stops at the
        first hash it lacks, because later blocks are useless without the earlier ones.  ``{}``
        when Redis fails, times out, or is being skipped.
        """
        keys = RedisKeys(self.key_prefix, model)
        worker_ids = list(dict.fromkeys(worker_ids))
        set_keys = [keys.blocks(wid) for wid in worker_ids]
        hashes = [_check_hash(h) for h in hashes]
        if not worker_ids:
            return {}
        if not hashes:
            return dict.fromkeys(worker_ids, 0)
        if not self.available:
            if self._probing or self.clock() < self._retry_at:
                self.skipped_total += 1
                return {}
            self._probing = True  # this lookup probes; the others keep skipping meanwhile
        chunks = list(_chunks(hashes))
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for key in set_keys:
                    for chunk in chunks:
                        pipe.smismember(key, chunk)
                results = await asyncio.wait_for(pipe.execute(), self.timeout_s)
        except (asyncio.TimeoutError, *UNAVAILABLE_ERRORS) as exc:
            self._unavailable(exc)
            return {}
        finally:
            self._probing = False
        if not self.available:
            log.warning("prefix index: Redis answers again; routing by cached prefixes")
        self.available = True
        matched: dict[str, int] = {}
        per_worker = len(chunks)
        for i, wid in enumerate(worker_ids):
            flags = [f for part in results[i * per_worker:(i + 1) * per_worker] for f in part]
            n = 0
            while n < len(flags) and flags[n]:
                n += 1
            matched[wid] = n
        return matched

    def _unavailable(self, exc: BaseException) -> None:
        if self.available:
            log.warning("prefix index: Redis unreachable, routing by load only; probing every %g s (%r)",
                        self.retry_interval_s, exc)
        self.available = False
        self._retry_at = self.clock() + self.retry_interval_s
        self.unavailable_total += 1
        if self.on_unavailable is not None:
            self.on_unavailable()
