"""The worker registry in Redis: who is serving which model, in which role, at what load.

Workers write their own entry (``register`` + a periodic ``Heartbeat``); the gateway and ops
scripts read the pool with ``list_workers``.  An entry is a JSON ``WorkerInfo`` under a key with a
TTL, so a worker that dies without deregistering disappears once the TTL runs out.  Key names are
in ``common.cluster.redis_keys``.

Reading takes two round trips: ZRANGE of the per-model index, then MGET of the entries.  Index
members whose entry has been gone for a long while are pruned by the reader.

Entries are signed with the cluster secret (``ClusterAuth.sign_entry``), because whoever can write
to Redis could otherwise register a worker that receives prompts and admin calls.  The signature
covers the entry's exact JSON bytes and is spliced in as its first field, so the value stays one
JSON object that older readers (which ignore unknown fields) still read::

    payload = {"worker_id":"p0","role":"prefill",...}                      (the WorkerInfo JSON)
    stored  = {"signature":"<hex HMAC(registry key, payload)>","worker_id":"p0",...}

Every entry carries, inside what is signed, the cluster auth version its worker speaks
(``auth_version``), the id of the worker's current run that requests to it are signed for
(``instance``: a request signed for an earlier run is refused, see ``common.cluster.auth``) and
when it expires (``expires_at`` = the write's ``heartbeat_at`` + the TTL, on the writer's
clock).  Redis drops the key at that time too; the signed copy is what stops an old
entry, written back into Redis by someone who captured it, from routing prompts and admin calls
to whoever holds that address now.  Clocks of different machines differ a little, so an entry
counts as expired only ``ENTRY_CLOCK_SKEW_S`` after its ``expires_at`` (and one written more than
that far in the reader's future is refused as well: its clock would stretch its life).

A reader with the secret keeps only entries whose signature verifies, that sit under their own
worker id and model, that speak this auth version, have not expired, and whose addresses are plain
``http://host:port`` and ``host``; it skips the rest like absent ones, logging each bad worker id
once and counting every skip (``on_rejected(reason)``: signature, unreadable, misplaced, version,
expired, clock, address).  Without a secret the version and the expiry are enforced all the same.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
import urllib.parse
from typing import Annotated, Callable, Collection, Literal

import msgspec
import redis.asyncio as aioredis
import redis.exceptions

from common.cluster.aio import cancel_and_wait
from common.cluster.auth import AUTH_VERSION, INSTANCE_RE, ClusterAuth, audience_of, new_instance_id
from common.cluster.redis_keys import DEFAULT_KEY_PREFIX, WORKER_ID_RE, RedisKeys, check_model_id, check_worker_id
from common.cluster.redis_util import UNAVAILABLE_ERRORS

log = logging.getLogger(__name__)

# How far apart the clocks of a reader and a writer may be (NTP keeps them far closer).  A captured
# entry written back into Redis is read as live for at most this long past its expiry.
ENTRY_CLOCK_SKEW_S = 30.0

Role = Literal["prefill", "decode", "both"]
# starting: loading weights, not routable yet; active: takes new requests; draining: finishes what
# it has, takes nothing new; idle: up but parked (e.g. drained, waiting for a role change).
WorkerState = Literal["starting", "active", "draining", "idle"]
ROLES: tuple[str, ...] = ("prefill", "decode", "both")
STATES: tuple[str, ...] = ("starting", "active", "draining", "idle")

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
WorkerId = Annotated[str, msgspec.Meta(pattern=rf"^{WORKER_ID_RE.pattern}$")]
Instance = Annotated[str, msgspec.Meta(pattern=rf"^{INSTANCE_RE.pattern}$")]
# A DNS name or an IP address (IPv6 with or without brackets); nothing a URL or a socket call could
# read as more than a host.
HOST_PATTERN = r"^([A-Za-z0-9_.-]{1,253}|\[?[0-9A-Fa-f:.]{2,45}\]?)$"
Host = Annotated[str, msgspec.Meta(pattern=HOST_PATTERN)]


# Registry entries tolerate unknown fields: during a rolling upgrade, old gateways read entries that
# newer workers wrote (and vice versa), and a new field must not make a live worker invisible.


class KVAddress(msgspec.Struct, frozen=True):
    """Where peers reach this worker's KV transfer endpoint."""

    transport: Literal["ucx", "tcp", "inproc"]
    host: Host
    port: Port


class Capacity(msgspec.Struct, frozen=True):
    """What the worker's engine was sized to (fixed for the worker's lifetime)."""

    num_kv_blocks: PosInt
    block_size: PosInt
    max_num_seqs: PosInt


class Load(msgspec.Struct, frozen=True):
    """The engine's load at the last heartbeat."""

    num_waiting: NonNegInt = 0
    num_running: NonNegInt = 0
    kv_usage: Fraction = 0.0
    num_waiting_prefill_tokens: NonNegInt = 0  # prompt tokens admitted but not yet computed
    prefill_tokens_per_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0  # prompt tokens computed, recent rate


class WorkerInfo(msgspec.Struct, frozen=True):
    """One worker's registry entry (the value stored in Redis, as JSON).

    ``heartbeat_at``, ``expires_at`` and ``auth_version`` are stamped by the registry on every
    write; ``started_at`` and ``instance`` by the worker.  Times are unix seconds.
    ``recent_ttft_s`` / ``recent_tpot_s`` are the worker's recent means, ``None`` until it has
    served something.  ``auth_version`` is 1 in entries of workers from before it existed
    (cluster auth v1).  ``instance`` identifies the worker's current run (random, drawn at start):
    requests to it are signed for ``audience``, so none outlives the run (``common.cluster.auth``).
    A worker passes its own; the default, a fresh one, suits entries of test fakes and simulations,
    whose calls no real worker verifies.
    """

    worker_id: WorkerId
    role: Role
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    http_address: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    kv_address: KVAddress
    capacity: Capacity
    state: WorkerState = "starting"
    load: Load = Load()
    recent_ttft_s: Seconds | None = None
    recent_tpot_s: Seconds | None = None
    started_at: Seconds = 0.0
    heartbeat_at: Seconds = 0.0
    expires_at: Seconds = 0.0
    auth_version: PosInt = 1
    instance: Instance = msgspec.field(default_factory=new_instance_id)

    @property
    def is_routable(self) -> bool:
        return self.state == "active"

    @property
    def audience(self) -> str:
        """What a request to this run of this worker is signed for (``ClusterAuth.sign_request``)."""
        return audience_of(self.worker_id, self.instance)


_encode = msgspec.json.Encoder().encode
_decode_info = msgspec.json.Decoder(WorkerInfo).decode


def check_http_address(url: str) -> str:
    """``url`` if it is exactly ``http://host:port`` (no credentials, path, query or fragment: a
    registry entry must not steer a request anywhere but to a worker's root); else ValueError."""
    if not isinstance(url, str) or any(c.isspace() or ord(c) < 32 or c == "\\" for c in url):
        raise ValueError(f"http_address {url!r}: must be http://host:port")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        port = None
        parts = None
    if (parts is None or parts.scheme != "http" or "@" in parts.netloc or parts.path or parts.query
            or parts.fragment or port is None or not 1 <= port <= 65535 or not parts.hostname
            or not re.fullmatch(HOST_PATTERN, parts.hostname)):
        raise ValueError(f"http_address {url!r}: must be http://host:port, nothing else")
    return url


def validate_worker_info(info: WorkerInfo) -> WorkerInfo:
    """Check the constraints msgspec only enforces when decoding; raise ValueError naming the field."""
    if not isinstance(info, WorkerInfo):
        raise TypeError(f"expected WorkerInfo, got {type(info).__name__}")
    try:
        checked = _decode_info(_encode(info))
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid WorkerInfo: {exc}") from None
    check_model_id(info.model)
    check_http_address(info.http_address)
    return checked


_SIGNATURE_HEAD = b'{"signature":"'
_SIGNED_RE = re.compile(rb'\{"signature":"([0-9a-f]{64})",(.*)', re.S)


def seal_entry(payload: bytes, auth: ClusterAuth) -> bytes:
    """The stored form of a WorkerInfo JSON ``payload``: its signature spliced in as the first field
    (the payload unchanged when auth is disabled)."""
    if not auth.enabled:
        return payload
    assert payload.startswith(b"{") and payload != b"{}", "a WorkerInfo encodes as a non-empty JSON object"
    return _SIGNATURE_HEAD + auth.sign_entry(payload).encode() + b'",' + payload[1:]


def open_entry(raw: bytes, auth: ClusterAuth) -> bytes | None:
    """The signed payload of a stored entry, or None when it is unsigned or its signature does not
    verify.  Without a secret every entry is taken as it is (a signature, if any, dropped)."""
    match = _SIGNED_RE.fullmatch(raw)
    if match is None:
        return None if auth.enabled else raw
    payload = b"{" + match.group(2)
    return payload if auth.verify_entry(payload, match.group(1).decode()) else None


class WorkerRegistry:
    """Reads and writes worker entries for any model under one key prefix.

    ``ttl_s`` is how long an entry outlives its last write.  Writes raise on Redis errors (the
    ``Heartbeat`` loop catches them); reads raise too, so the caller decides how to degrade.
    """

    # Index members whose entry is gone are removed only after this long past their expiry, so a
    # reader with a skewed clock never prunes a worker that is merely between heartbeats.
    PRUNE_AFTER_S = 60.0

    # Worker ids whose bad entries were logged (bounded: anyone who can write to Redis picks them).
    MAX_LOGGED_REJECTIONS = 1024

    def __init__(self, client: aioredis.Redis, *, key_prefix: str = DEFAULT_KEY_PREFIX, ttl_s: float = 5.0,
                 auth: ClusterAuth | None = None, on_rejected: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        """``auth``: signs written entries and verifies read ones (None: no secret, loopback-only
        deployments; entries are then neither signed nor checked).  ``on_rejected(reason)`` is
        called for every entry skipped on read (a metric).  ``clock``: unix time, for the
        entries' times and their expiry (tests pass their own)."""
        if not 0 < ttl_s <= 3600:
            raise ValueError(f"ttl_s must be in (0, 3600], got {ttl_s}")
        RedisKeys(key_prefix, "probe")  # validates the prefix now rather than on first use
        self.client = client
        self.key_prefix = key_prefix
        self.ttl_s = ttl_s
        self.auth = auth or ClusterAuth.disabled()
        self.on_rejected = on_rejected
        self.clock = clock
        self._logged_rejections: set[str] = set()
        self._prune_refused = False  # Redis refused the last pruning of lapsed entries (warned once)

    def keys(self, model: str) -> RedisKeys:
        return RedisKeys(self.key_prefix, model)

    async def register(self, info: WorkerInfo) -> WorkerInfo:
        """Write (or refresh) the entry, stamping ``heartbeat_at``, ``expires_at`` and
        ``auth_version``; returns what was written."""
        now = self.clock()
        info = msgspec.structs.replace(validate_worker_info(info), heartbeat_at=now, expires_at=now + self.ttl_s,
                                       auth_version=AUTH_VERSION)
        keys = self.keys(info.model)
        ttl_ms = max(1, int(self.ttl_s * 1000))
        expiry_ms = int(info.heartbeat_at * 1000) + ttl_ms
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(keys.worker(info.worker_id), seal_entry(_encode(info), self.auth), px=ttl_ms)
            pipe.zadd(keys.workers, {info.worker_id: expiry_ms})
            await pipe.execute()
        return info

    async def deregister(self, model: str, worker_id: str) -> None:
        """Remove the entry and the worker's prefix-index set at once (clean shutdown)."""
        keys = self.keys(model)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(keys.worker(worker_id), keys.blocks(worker_id))
            pipe.zrem(keys.workers, check_worker_id(worker_id))
            await pipe.execute()

    async def get(self, model: str, worker_id: str) -> WorkerInfo | None:
        """The worker's entry, or None if it is absent or does not verify."""
        raw = await self.client.get(self.keys(model).worker(worker_id))
        return None if raw is None else self._read(raw, model, worker_id)

    async def list_workers(
        self,
        model: str,
        *,
        roles: Collection[str] | None = None,
        states: Collection[str] | None = None,
    ) -> list[WorkerInfo]:
        """Live workers of ``model``, sorted by worker_id, optionally filtered by exact role/state."""
        for name, values, allowed in (("role", roles, ROLES), ("state", states, STATES)):
            bad = sorted(set(values or ()) - set(allowed))
            if bad:
                raise ValueError(f"unknown {name}(s) {bad}; expected some of {list(allowed)}")
        keys = self.keys(model)
        members = await self.client.zrange(keys.workers, 0, -1, withscores=True)
        if not members:
            return []
        ids = [m.decode() for m, _ in members]
        raws = await self.client.mget([keys.worker_key_prefix + wid for wid in ids])
        stale_before_ms = (self.clock() - self.PRUNE_AFTER_S) * 1000
        stale = [wid for (wid, (_, expiry_ms), raw) in zip(ids, members, raws)
                 if raw is None and expiry_ms < stale_before_ms]
        if stale:
            try:  # housekeeping: a Redis that refuses writes (MISCONF, READONLY replica) is still read
                await self.client.zrem(keys.workers, *stale)
                self._prune_refused = False
            except redis.exceptions.ResponseError as exc:
                log.log(logging.DEBUG if self._prune_refused else logging.WARNING,
                        "registry: Redis refuses to prune %d lapsed workers (said once until it takes it): %s",
                        len(stale), exc)
                self._prune_refused = True
        workers = [w for w in (self._read(raw, model, wid) for wid, raw in zip(ids, raws) if raw is not None)
                   if w is not None]
        return sorted(
            (w for w in workers
             if (roles is None or w.role in roles) and (states is None or w.state in states)),
            key=lambda w: w.worker_id,
        )

    def expired(self, info: WorkerInfo, now: float | None = None) -> bool:
        """Whether ``info`` has expired for readers (``ENTRY_CLOCK_SKEW_S`` past its ``expires_at``
        on this registry's clock): an entry read earlier and kept stops counting then too."""
        return (self.clock() if now is None else now) > info.expires_at + ENTRY_CLOCK_SKEW_S

    def _read(self, raw: bytes, model: str, worker_id: str) -> WorkerInfo | None:
        """The entry stored under ``model``/``worker_id`` if it is trustworthy, else None."""
        payload = open_entry(raw, self.auth)
        if payload is None:
            return self._reject(worker_id, "signature", "it is unsigned or its signature does not verify "
                                                        "(forged, or written with another cluster secret)")
        try:
            info = _decode_info(payload)
        except msgspec.DecodeError as exc:
            # A worker running a newer/older schema must not take the reader down with it.
            return self._reject(worker_id, "unreadable", str(exc))
        if info.worker_id != worker_id or info.model != model:
            return self._reject(worker_id, "misplaced", f"it describes worker {info.worker_id!r} of model "
                                                        f"{info.model!r}")
        if info.auth_version != AUTH_VERSION:
            return self._reject(worker_id, "version", f"its worker speaks cluster auth v{info.auth_version}, this "
                                                      f"process v{AUTH_VERSION}: run one pdserve version across "
                                                      "the cluster")
        now = self.clock()
        if self.expired(info, now):
            return self._reject(worker_id, "expired", f"it expired {now - info.expires_at:.0f} s ago (an old entry "
                                                      "written back into Redis, or this machine's clock is more than "
                                                      f"{ENTRY_CLOCK_SKEW_S:.0f} s ahead of the worker's)")
        if info.heartbeat_at > now + ENTRY_CLOCK_SKEW_S:
            return self._reject(worker_id, "clock", f"it was written {info.heartbeat_at - now:.0f} s in this "
                                                    "machine's future (the worker's clock is more than "
                                                    f"{ENTRY_CLOCK_SKEW_S:.0f} s ahead)")
        try:
            check_http_address(info.http_address)
        except ValueError as exc:
            return self._reject(worker_id, "address", str(exc))
        return info

    def _reject(self, worker_id: str, reason: str, why: str) -> None:
        if self.on_rejected is not None:
            self.on_rejected(reason)
        if worker_id not in self._logged_rejections and len(self._logged_rejections) < self.MAX_LOGGED_REJECTIONS:
            self._logged_rejections.add(worker_id)
            log.warning("ignoring the registry entry of worker %r: %s", worker_id, why)
        return None


class Heartbeat:
    """Keeps one worker's registry entry alive: writes ``info_fn()`` every ``interval_s``.

    ``info_fn`` returns the worker's current WorkerInfo (state and load change between beats).
    A failed write (Redis down) is logged and counted, never raised: the worker keeps serving and
    the next beat re-creates the entry.  ``stop()`` deregisters by default (clean shutdown).
    """

    def __init__(self, registry: WorkerRegistry, info_fn: Callable[[], WorkerInfo], *,
                 interval_s: float | None = None) -> None:
        interval_s = registry.ttl_s / 3 if interval_s is None else interval_s
        if not 0 < interval_s < registry.ttl_s:
            raise ValueError(
                f"heartbeat interval_s must be in (0, ttl_s={registry.ttl_s}), got {interval_s}")
        self.registry = registry
        self.info_fn = info_fn
        self.interval_s = interval_s
        self.failures = 0
        self.last: WorkerInfo | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._writing = asyncio.Lock()

    async def beat(self) -> bool:
        """Write the entry now (also used right after a state change); True on success.  Beats
        are written one at a time, each with the state of its own turn: a periodic beat that read
        the state before a change never lands after the change's beat.  False once stopped: a
        stopped worker's entry stays gone (a late role change re-registered an exiting process)."""
        async with self._writing:
            return False if self._stopping else await self._write()

    async def _write(self) -> bool:
        try:
            info = self.info_fn()
            self.last = await self.registry.register(info)
            return True
        except UNAVAILABLE_ERRORS as exc:
            self.failures += 1
            log.warning("heartbeat failed (%d so far), Redis unreachable: %s", self.failures, exc)
            return False
        except Exception:  # a bad WorkerInfo from the engine must not kill the loop silently
            self.failures += 1
            log.exception("heartbeat failed (%d so far)", self.failures)
            return False

    async def start(self) -> None:
        """Register once (raising if the entry is invalid), then beat in the background."""
        if self._task is not None:
            raise RuntimeError("heartbeat already started")
        validate_worker_info(self.info_fn())
        await self.beat()
        self._task = asyncio.create_task(self._run(), name="registry-heartbeat")

    async def _run(self) -> None:
        # The flag, not only cancel(): on Python 3.11 a cancel that lands as a redis-py socket
        # wait_for completes is lost (CPython gh-86296), and the loop would run on.
        while not self._stopping:
            await asyncio.sleep(self.interval_s)
            await self.beat()

    async def stop(self, *, deregister: bool = True) -> None:
        task, self._task = self._task, None
        self._stopping = True
        await cancel_and_wait(task)
        if deregister:
            info = self.info_fn()
            try:
                await self.registry.deregister(info.model, info.worker_id)
            except UNAVAILABLE_ERRORS as exc:
                log.warning("deregister of worker %s failed (its entry will expire): %s", info.worker_id, exc)
