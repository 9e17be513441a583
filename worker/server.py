"""The worker process: engine thread + KV endpoints + HTTP API + registry heartbeat.

HTTP API (internal; the gateway and peers call it; every endpoint but /health needs a request signed
with the cluster secret, see ``request_auth``):

    POST /generate   GenerateRequest  -> stream of TokenFrame   (decode_svc's role module)
    POST /prefill    PrefillRequest   -> PrefillResult          (prefill_svc's role module)
    POST /abort      AbortRequest     -> 200 whether or not the request was here
    GET  /health                      -> 200 while serving, 503 once the engine has failed
    GET  /stats[?check=1]             -> JSON counters (tests and ops); check=1 adds the block
                                         pool's integrity check (pool_ok, pool_error) and the
                                         requests the engine still holds (num_unfinished)
    GET  /metrics                     -> Prometheus text
    GET  /admin/status, POST /admin/drain, POST /admin/role   (the gateway's, signed like every call)
    GET  /admin/steps?since=&limit=   -> the engine's recent steps: time, duration, shape

Counters read on the event loop (/stats, /metrics, the heartbeat) come from the snapshot the engine
thread publishes after each step, never from the scheduler itself, which changes under them.

A failed engine (repeated step failures, or a step or engine call that outlives the watchdog's
bound, ``--engine-watchdog``: a hung engine thread) fails the worker: it leaves the registry, /health
answers 503, every request in flight or arriving gets an explicit error, and ``failed`` is set so the
process exits non-zero after a short drain (its supervisor restarts it; ``worker.main``
bounds that exit).  A step that hangs holding the GIL, so that not even the watchdog runs, ends the
process from a C timer (``worker.hang_backstop``).

The role only decides which of /generate and /prefill a worker accepts; the engine is the same,
so a role change needs no restart.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Sequence

import aiohttp
import msgspec
from aiohttp import web

from common.engine.engine import Engine
from common.engine.step_log import COLUMNS as STEP_COLUMNS
from worker.engine_thread import EngineFailed, EngineThread
from worker.fault_injection import fault_injector_from_env, stick_an_executor_thread
from common.cluster.auth import new_instance_id
from common.cluster.messages import MAX_FRAME_BYTES, AbortRequest, decode
from common.cluster.prefix_index import PrefixIndexPublisher
from common.cluster.redis_util import connect
from common.cluster.registry import Capacity, Heartbeat, KVAddress, Load, WorkerInfo, WorkerRegistry
from worker.config import ROLES, WorkerConfig
from worker.metrics import WorkerMetrics
from worker.peers import PeerDirectory
from worker.recent import RecentLatency, RecentRate
from worker.request_auth import cluster_auth_middleware
from worker.roles import RoleModule
from common.cluster.http_listener import GuardedSite
from kvtransfer.config import parse_address
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import KVSender
from kvtransfer.socket_io import failed_listeners, listener_stats

log = logging.getLogger(__name__)

STEPS_PAGE = 4096  # most steps one /admin/steps answer holds (about 400 KB of JSON)


def peer_session(config: WorkerConfig) -> aiohttp.ClientSession:
    """The session for calls to other workers.  Every call is bounded: connecting (a pooled
    connection included) by ``peer_connect_timeout_s``, a control call as a whole by
    ``control_timeout_s`` (the default here), a remote prefill by the KV transfer timeout (set on
    that call).  The pool holds a /prefill and an /abort for every request this worker may have
    in flight, so no call waits behind the library's default limit of 100."""
    connect = config.peer_connect_timeout_s
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=config.control_timeout_s, connect=connect, sock_connect=connect),
        connector=aiohttp.TCPConnector(limit=2 * config.max_pending_requests),
    )


class Worker:
    """One worker process.  ``start()`` loads the model and joins the pool; ``stop()`` leaves it."""

    def __init__(self, config: WorkerConfig, modules: Sequence[RoleModule]):
        self.config = config
        self.modules = list(modules)
        self.auth = config.auth()  # signs calls to peers, checks calls from them
        self.role = config.role
        self.state = "starting"
        self.engine: Engine | None = None
        self.engine_thread: EngineThread | None = None
        self.kv_receiver: KVReceiver | None = None
        self.kv_sender: KVSender | None = None
        self.kv_address: KVAddress | None = None
        self.inflight: dict[str, asyncio.Task] = {}
        self.metrics = WorkerMetrics()
        self.ttft = RecentLatency()
        self.tpot = RecentLatency()
        self.prefill_rate = RecentRate()
        self._drain_task: asyncio.Task | None = None
        self.started_at = time.time()
        self.instance = new_instance_id()  # this run's: requests to it are signed for it (auth v3)
        self._idle = asyncio.Event()
        self._redis = None
        self._heartbeat: Heartbeat | None = None
        self._publisher: PrefixIndexPublisher | None = None
        self._runner: web.AppRunner | None = None
        self.http_port = config.port
        self.http_client: aiohttp.ClientSession | None = None  # calls to peer workers
        self.peers: PeerDirectory | None = None  # where peer workers are, by worker id
        self._background: set[asyncio.Task] = set()
        self.failure: BaseException | None = None  # set once the engine has failed
        self.failed = asyncio.Event()

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.http_client = peer_session(self.config)
        self.engine = await asyncio.to_thread(Engine, self.config.engine, load_tokenizer=False)
        self.engine_thread = EngineThread(self.engine, loop, max_step_failures=self.config.max_step_failures,
                                          watchdog_s=self.config.engine_watchdog_s, hang_backstop=True)
        self.engine_thread.after_step.append(self._publish_cache_events)
        self.engine_thread.on_fatal = self._engine_failed
        self.engine_thread.on_lease_expired = self._leases_expired
        self.engine.fault_injector = fault_injector_from_env()
        stick_an_executor_thread(loop)
        # No internal message is larger than a frame: a bigger body is refused while it is read.
        refused = self.metrics.auth_refused.labels
        verifier = self.auth.request_verifier(self.config.worker_id, self.instance)
        app = web.Application(client_max_size=MAX_FRAME_BYTES,
                              middlewares=[cluster_auth_middleware(verifier, lambda why: refused(why).inc())])
        self._routes(app)
        for module in self.modules:
            module.install(self, app)
        self.engine_thread.start()

        self.kv_receiver = KVReceiver(self.engine.kv_cache, self.config.kv, auth=self.auth)
        host, port = parse_address(await self.kv_receiver.start())
        self.kv_sender = KVSender(self.engine.kv_cache, self.config.kv, auth=self.auth)
        self.kv_address = KVAddress(transport=self.config.kv.transport,
                                    host=self.config.advertise_host or host, port=port)

        self._redis = connect(self.config.redis_url)
        registry = WorkerRegistry(self._redis, key_prefix=self.config.key_prefix, ttl_s=self.config.heartbeat_ttl_s,
                                  auth=self.auth)
        self.peers = PeerDirectory(registry, self.engine.model_id)  # before the first request can arrive

        self._runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = GuardedSite(self._runner, self.config.host, self.config.port, self.config.http)
        await site.start()
        self.http_port = site.port

        self._publisher = PrefixIndexPublisher(
            self._redis, model=self.engine.model_id, worker_id=self.config.worker_id,
            key_prefix=self.config.key_prefix, ttl_s=self.config.heartbeat_ttl_s,
        )
        await self._publisher.start()
        self.state = "active"
        self._heartbeat = Heartbeat(registry, self.info)
        await self._heartbeat.start()
        log.info("worker %s serving as %s: http %s, kv %s://%s:%d", self.config.worker_id, self.role,
                 self.http_url, self.kv_address.transport, self.kv_address.host, self.kv_address.port)

    async def stop(self) -> None:
        self.state = "draining"
        for task in list(self.inflight.values()):
            task.cancel()
        if self._heartbeat:
            await self._heartbeat.stop()
        if self._publisher:
            await self._publisher.stop()
        if self._runner:
            await self._runner.cleanup()
        if self.kv_receiver:
            await self.kv_receiver.close()
        if self.kv_sender:
            await self.kv_sender.close()  # each closes its transport (the UCX worker's threads too)
        if self.engine_thread:
            self.engine_thread.stop()
        for task in list(self._background):
            task.cancel()
        if self.http_client:
            await self.http_client.close()
        if self._redis:
            await self._redis.aclose()

    @property
    def http_url(self) -> str:
        host = self.config.public_host
        return f"http://[{host}]:{self.http_port}" if ":" in host else f"http://{host}:{self.http_port}"

    @property
    def reservation_lease_s(self) -> float:
        """How long blocks reserved for remote KV may wait: the transfer's own bound, then the
        grace for an aborted payload to stop landing, with room for the calls in between."""
        kv = self.config.kv
        return kv.transfer_timeout + kv.abort_grace + 2 * self.config.control_timeout_s

    def info(self) -> WorkerInfo:
        """This worker's registry entry, as of the engine thread's last snapshot."""
        stats = self.engine_thread.snapshot
        waiting_tokens = stats["num_waiting_prefill_tokens"]
        computed = stats["prompt_tokens_total"] - stats["prefix_cache_hit_tokens_total"]
        return WorkerInfo(
            worker_id=self.config.worker_id, role=self.role, model=self.engine.model_id,
            http_address=self.http_url, kv_address=self.kv_address,
            capacity=Capacity(num_kv_blocks=stats["num_blocks"], block_size=self.engine.config.block_size,
                              max_num_seqs=self.engine.config.max_num_seqs),
            state="draining" if self.failure is not None else self.state,
            load=Load(num_waiting=stats["num_waiting"], num_running=stats["num_running"],
                      kv_usage=min(1.0, max(0.0, stats["kv_usage"])), num_waiting_prefill_tokens=waiting_tokens,
                      prefill_tokens_per_s=self.prefill_rate.update(computed)),
            recent_ttft_s=self.ttft.mean, recent_tpot_s=self.tpot.mean, started_at=self.started_at,
            instance=self.instance,
        )

    def _engine_failed(self, exc: BaseException) -> None:
        """Event loop: the engine thread has stopped for good.  Leave the pool now; the process
        exits once what is in flight has got its error (``failed``)."""
        if self.failure is not None:
            return
        log.error("worker %s: the engine failed (%s); leaving the pool", self.config.worker_id, exc)
        self.failure = exc  # every stream has its error already (EngineThread)

        async def leave() -> None:
            try:
                if self._heartbeat is not None:
                    await self._heartbeat.stop(deregister=True)
            finally:
                self.failed.set()

        self.spawn(leave())

    def _leases_expired(self, request_ids: list[str]) -> None:
        """Event loop: reservations whose KV never came in time.  Their handler gives them up (it
        frees the blocks once no more bytes can land).  Without a handler in flight none of them
        has a transfer either (a handler stays in ``inflight`` until its transfer has settled and
        its blocks are freed), so such an orphan is freed at once."""
        for request_id in request_ids:
            task = self.inflight.get(request_id)
            if task is not None:
                task.cancel()
            else:
                self.spawn(self._free_orphan(request_id))

    async def _free_orphan(self, request_id: str) -> None:
        try:
            await self.engine_thread.call(lambda e: e.abort(request_id))
        except EngineFailed:
            pass

    def _publish_cache_events(self, engine: Engine, _outputs) -> None:
        """Engine thread: forward committed/evicted block hashes to the Redis prefix index."""
        stored, removed = engine.block_pool.take_events()
        if self._publisher is not None:
            if removed:
                self._publisher.remove(removed)
            if stored:
                self._publisher.publish(stored)

    def spawn(self, coro) -> asyncio.Task:
        """A fire-and-forget task that is still cancelled on shutdown (no leaked tasks)."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # ---- admission and in-flight tracking --------------------------------------------------

    def accepts(self, kind: str) -> tuple[str, str] | None:
        """Why a new ``kind`` ("generate" or "prefill") request is refused now, or None.

        Returns ``(error_kind, reason)``: "refused" when the caller's view of this worker is stale
        (it drains, or its role changed), "busy" when it is simply full."""
        if self.failure is not None:
            return "refused", f"worker failed: {self.failure}"
        if self.state != "active":
            return "refused", f"worker is {self.state}"
        wanted = ("decode", "both") if kind == "generate" else ("prefill", "both")
        if self.role not in wanted:
            return "refused", f"worker role is {self.role}, not {' or '.join(wanted)}"
        if len(self.inflight) >= self.config.max_pending_requests:
            return "busy", f"worker has {len(self.inflight)} requests in flight (limit {self.config.max_pending_requests})"
        return None

    def track(self, request_id: str) -> None:
        task = asyncio.current_task()
        if request_id in self.inflight:
            raise ValueError(f"request_id {request_id!r} is already in flight on this worker")
        self.inflight[request_id] = task
        self._idle.clear()

    def untrack(self, request_id: str) -> None:
        """Forget a request that holds nothing on this worker (refused before it got anything)."""
        self.inflight.pop(request_id, None)
        if not self.inflight:
            self._idle.set()

    def finish_request(self, request_id: str, engine_cleanup, then=None, wait_for: asyncio.Future | None = None) -> None:
        """End a request's handler: wait for ``wait_for`` (e.g. an abandoned KV transfer settling),
        run ``engine_cleanup(engine)`` in the engine thread, then the ``then`` coroutine, then
        forget the request.  Runs as its own task so a handler cancelled mid-cleanup (the peer
        hung up) still frees everything."""

        async def cleanup() -> None:
            try:
                if wait_for is not None:
                    await asyncio.wait([wait_for])
                try:
                    await self.engine_thread.call(engine_cleanup)
                except EngineFailed:
                    pass  # nothing runs any more; the process exits
                if then is not None:
                    await then
            finally:
                self.untrack(request_id)

        self.spawn(cleanup())

    async def abort(self, request_id: str) -> bool:
        """Abort a request here: cancel its handler (which frees blocks and tells peers)."""
        task = self.inflight.get(request_id)
        if task is None:
            return False
        task.cancel()
        return True

    def begin_drain(self) -> asyncio.Task:
        """Stop taking new requests now; the returned task finishes when nothing is in flight and
        the worker reports idle.  A role change before then cancels the drain (the worker is
        active again), so a late "idle" never parks a worker that was put back to work."""
        self.state = "draining"
        if self._drain_task is None or self._drain_task.done():
            self._drain_task = self.spawn(self._finish_drain())
        return self._drain_task

    async def _finish_drain(self) -> None:
        await self._heartbeat.beat()
        if self.inflight:
            await self._idle.wait()
        if self.state == "draining":
            self.state = "idle"
            await self._heartbeat.beat()

    async def wait_idle(self, timeout: float) -> None:
        """Wait until nothing is in flight, at most ``timeout`` seconds."""
        if self.inflight:
            await asyncio.wait([asyncio.ensure_future(self._idle.wait())], timeout=timeout)

    async def drain(self) -> None:
        """Stop taking new requests, finish what is in flight, then report idle."""
        await self.begin_drain()

    async def set_role(self, role: str) -> None:
        """Change what this worker accepts from now on; work in flight completes as it started.

        Leaving the decode pool: running streams keep decoding here until they finish (only new
        /generate calls are refused).  Leaving the prefill pool: prefills in flight finish and ship
        their KV.  The registry entry is rewritten at once, so the gateway routes by the new role
        on its next read.  Also the way back from a drain: the worker becomes active again."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
        log.info("role change %s -> %s", self.role, role)
        self.role = role
        if self._drain_task is not None and not self._drain_task.done():
            self._drain_task.cancel()
        if self.state in ("idle", "draining"):
            self.state = "active"
        await self._heartbeat.beat()

    # ---- HTTP ------------------------------------------------------------------------------

    def _routes(self, app: web.Application) -> None:
        """Routes every worker has; the role modules add /generate and /prefill."""
        app.router.add_post("/abort", self._handle_abort)
        app.router.add_get("/health", self._handle_health)
        app.router.add_get("/stats", self._handle_stats)
        app.router.add_get("/metrics", self._handle_metrics)
        # The admin calls' authority is the cluster signature (for this worker, used once), as for
        # every route: operators go through the gateway's /admin, which checks their admin token.
        app.router.add_get("/admin/status", self._handle_status)
        app.router.add_get("/admin/steps", self._handle_steps)
        app.router.add_post("/admin/drain", self._handle_drain)
        app.router.add_post("/admin/role", self._handle_role)

    async def _handle_abort(self, request: web.Request) -> web.Response:
        try:
            body = decode(await request.read(), AbortRequest)
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        found = await self.abort(body.request_id)
        return web.json_response({"aborted": found})

    async def _handle_health(self, _request: web.Request) -> web.Response:
        healthy = self.engine_thread is not None and self.engine_thread.fatal_error is None
        status = "ok" if healthy else "engine failed"
        if healthy and failed_listeners():  # the KV port stopped accepting: no prefill reaches this worker
            healthy, status = False, "kv listener down"
        return web.json_response({"status": status, "role": self.role, "state": self.state,
                                  "instance": self.instance}, status=200 if healthy else 503)

    def stats(self, engine_stats: dict | None = None) -> dict:
        """Counters for /stats: the engine's from its last snapshot (or ``engine_stats``)."""
        out = dict(self.engine_thread.snapshot if engine_stats is None else engine_stats)
        out.update(self.metrics.snapshot())
        out.update(worker_id=self.config.worker_id, role=self.role, state=self.state,
                   inflight=len(self.inflight),
                   kv_incoming=self.kv_receiver.num_pending if self.kv_receiver else 0,
                   kv_outgoing=self.kv_sender.num_in_flight if self.kv_sender else 0,
                   failed=None if self.failure is None else str(self.failure))
        out.update(listener_stats())  # KV accept errors survived, unauthenticated connections closed
        return out

    async def _handle_stats(self, request: web.Request) -> web.Response:
        if request.query.get("check") not in ("1", "true"):
            return web.json_response(self.stats())

        def collect(engine: Engine) -> dict:  # engine thread: nothing changes under the check
            out = dict(engine.stats(), engine_steps=self.engine_thread.steps,
                       engine_step_failures=self.engine_thread.step_failures,
                       num_unfinished=engine.scheduler.num_unfinished)  # requests the engine still holds
            try:
                engine.scheduler.check_integrity()
                out.update(pool_ok=True, pool_error=None)
            except AssertionError as exc:
                out.update(pool_ok=False, pool_error=str(exc))
            return out

        try:
            return web.json_response(self.stats(await self.engine_thread.call(collect)))
        except EngineFailed:
            return web.json_response(dict(self.stats(), pool_ok=None, pool_error="the engine has failed"))

    async def _handle_metrics(self, _request: web.Request) -> web.Response:
        self.metrics.observe_engine(self.engine_thread.snapshot)
        return web.Response(body=self.metrics.render(), content_type="text/plain")

    async def _handle_status(self, _request: web.Request) -> web.Response:
        return web.Response(body=msgspec.json.encode(self.info()), content_type="application/json")

    async def _handle_steps(self, request: web.Request) -> web.Response:
        """The engine's recent steps (``common.engine.step_log``): ``?since=<unix time>`` those that
        ended after it, at most ``?limit=`` (default and most ``STEPS_PAGE``), oldest first."""
        try:
            since = float(request.query.get("since", "-inf"))
            limit = int(request.query.get("limit", STEPS_PAGE))
            if math.isnan(since) or not 1 <= limit <= STEPS_PAGE:
                raise ValueError
        except ValueError:
            return web.json_response({"error": f"expected ?since=<unix time>&limit=<1-{STEPS_PAGE}>"}, status=400)
        engine = self.engine
        step_log = engine.step_log
        rows = step_log.since(since, limit + 1)
        settings = {"model_id": engine.model_id, "dtype": engine.layout.dtype, "block_size": engine.layout.block_size,
                    "kv_bytes_per_token": engine.layout.block_nbytes / engine.layout.block_size,
                    "max_num_batched_tokens": engine.config.max_num_batched_tokens,
                    "max_num_seqs": engine.config.max_num_seqs, "max_model_len": engine.max_model_len}
        body = {"worker_id": self.config.worker_id, "role": self.role, "engine": settings,
                "columns": list(STEP_COLUMNS), "steps": rows[:limit].tolist(), "more": len(rows) > limit,
                "recorded": step_log.total, "kept": len(step_log)}
        return web.Response(body=msgspec.json.encode(body), content_type="application/json")

    async def _handle_drain(self, _request: web.Request) -> web.Response:
        self.begin_drain()
        return web.json_response({"worker_id": self.config.worker_id, "role": self.role, "state": self.state})

    async def _handle_role(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            role = body["role"]
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": 'expected a JSON body {"role": "prefill|decode|both"}'}, status=400)
        try:
            await self.set_role(role)
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response({"worker_id": self.config.worker_id, "role": self.role, "state": self.state})
