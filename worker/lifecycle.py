"""The worker process's life: ``Worker`` loads the engine, opens the KV endpoints, installs the role
modules (``RoleContext``), joins the registry and serves until it drains or stops.

Its HTTP API is internal (the gateway and peers call it; every endpoint but /health needs a request
signed with the cluster secret, see ``request_auth``): POST /generate (``decode_svc``), POST
/prefill (``prefill_svc``), and the routes every worker has (``admin_routes``).  Requests in flight
are tracked by ``in_flight``.

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
import time
from typing import Sequence

import aiohttp
from aiohttp import web

from common.cluster.auth import new_instance_id
from common.cluster.http_listener import GuardedSite
from common.cluster.messages import MAX_FRAME_BYTES
from common.cluster.prefix_index import PrefixIndexPublisher
from common.cluster.redis_util import UNAVAILABLE_ERRORS, connect
from common.cluster.registry import Capacity, Heartbeat, KVAddress, Load, WorkerInfo, WorkerRegistry
from common.engine import openmp_wait
from common.engine.config import EngineConfig
from common.engine.core_turns import CoreTurns
from common.engine.engine import Engine
from common.engine.sampling_params import SamplingParams
from common.engine.structured.backend import CompiledGrammar
from kvtransfer.config import parse_address
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import KVSender
from kvtransfer.socket_io import listener_stats
from worker.admin_routes import ShuttingDown, add_admin_routes
from worker.config import ROLES, WorkerConfig
from worker.engine_thread import EngineFailed, EngineThread
from worker.fault_injection import fault_injector_from_env, stick_an_executor_thread
from worker.in_flight import InFlight
from worker.metrics import WorkerMetrics
from worker.peers import PeerDirectory
from worker.recent import RecentLatency, RecentRate
from worker.request_auth import cluster_auth_middleware
from worker.role_context import ModelShape, RoleContext, RoleModule
from worker.tensor_ranks import TensorRanks

log = logging.getLogger(__name__)
STOP_FOLLOWERS_S = 30.0  # rank 0 tells the followers to stop between two steps; a step may be in flight
STREAM_END_POLL_S = 0.05  # how often a drain waiting for pre-copies looks for streams that ended meanwhile


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


def build_engine(config: EngineConfig) -> Engine:
    """The worker's engine, built in the calling (executor) thread, which then ends its OpenMP team:
    the engine thread is to be the process's one computing thread, or libgomp, managing more
    threads than CPUs, stops spinning between parallel regions (``openmp_wait``; a batch-1 decode
    step ~54 -> ~61 ms on 2 cores)."""
    try:
        return Engine(config, load_tokenizer=False)
    finally:
        openmp_wait.release_thread_team()


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
        self._background: set[asyncio.Task] = set()
        self.in_flight = InFlight(lambda: self.engine_thread, self.spawn)
        self.metrics = WorkerMetrics()
        self.ttft = RecentLatency()
        self.tpot = RecentLatency()
        self.prefill_rate = RecentRate()
        self._drain_task: asyncio.Task | None = None
        self.shutting_down = False  # its drain ends with the process: no role change brings it back
        self.movable_streams: set[str] = set()  # streams a drain hands over (``RoleContext``)
        self.exports_due: set[str] = set()  # streams handed over whose KV may still be fetched from here
        self.precopies_due: set[str] = set()  # streams told of their hand-over, whose KV may be pre-copied
        self._export_ended = asyncio.Event()
        self.started_at = time.time()
        self.instance = new_instance_id()  # this run's: requests to it are signed for it (auth v3)
        self._redis = None
        self._heartbeat: Heartbeat | None = None
        self._publisher: PrefixIndexPublisher | None = None
        self._runner: web.AppRunner | None = None
        self.http_port = config.port
        self.http_client: aiohttp.ClientSession | None = None  # calls to peer workers
        self.peers: PeerDirectory | None = None  # where peer workers are, by worker id
        self.failure: BaseException | None = None  # set once the engine has failed
        self.ranks: TensorRanks | None = None  # the follower ranks of a tensor-parallel worker
        self.failed = asyncio.Event()

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.http_client = peer_session(self.config)
        if self.config.engine.tensor_parallel_size > 1:  # the follower ranks first: the engine joins them
            self.ranks = TensorRanks(self.config.engine)
            await asyncio.to_thread(self.ranks.start)
            self.ranks.watch(lambda why: loop.call_soon_threadsafe(self._engine_failed, RuntimeError(why)))
        self.engine = await asyncio.to_thread(build_engine, self.config.engine)
        if unavailable := await self.engine.grammars.prepare():  # before it serves (GrammarCompiler.prepare)
            log.warning("structured output is unavailable on this worker: %s", unavailable)
        turns = CoreTurns(self.config.core_turns) if self.config.core_turns else None
        self.engine_thread = EngineThread(self.engine, loop, max_step_failures=self.config.max_step_failures,
                                          watchdog_s=self.config.engine_watchdog_s, hang_backstop=True,
                                          core_turns=turns)
        self.engine.block_pool.record_events = True  # published after each step
        self.engine_thread.after_step.append(self._publish_cache_events)
        self.engine_thread.on_fatal = self._engine_failed
        self.engine_thread.on_lease_expired = self._leases_expired
        self.engine.fault_injector = fault_injector_from_env()
        stick_an_executor_thread(loop)

        # Every rank's cache: the KV of a tensor-parallel worker moves in the ranks' own memory.
        self.kv_receiver = KVReceiver(self.engine.kv_shards, self.config.kv, auth=self.auth)
        host, port = parse_address(await self.kv_receiver.start())
        self.kv_sender = KVSender(self.engine.kv_shards, self.config.kv, auth=self.auth)
        self.kv_address = KVAddress(transport=self.config.kv.transport,
                                    host=self.config.advertise_host or host, port=port)

        self._redis = connect(self.config.redis_url)
        registry = WorkerRegistry(self._redis, key_prefix=self.config.key_prefix, ttl_s=self.config.heartbeat_ttl_s,
                                  auth=self.auth)
        self.peers = PeerDirectory(registry, self.engine.model_id)  # before the first request can arrive

        # No internal message is larger than a frame: a bigger body is refused while it is read.
        refused = self.metrics.auth_refused.labels
        verifier = self.auth.request_verifier(self.config.worker_id, self.instance)
        app = web.Application(client_max_size=MAX_FRAME_BYTES,
                              middlewares=[cluster_auth_middleware(verifier, lambda why: refused(why).inc())])
        add_admin_routes(self, app)
        context = self.role_context()
        for module in self.modules:
            module.install(context, app)
        self.engine_thread.start()

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
        self.in_flight.cancel_all()
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
        if self.ranks is not None and self.engine_thread and self.failure is None:
            try:  # between two steps, in the thread that runs the collectives
                await asyncio.wait_for(self.engine_thread.call(lambda e: e.stop_followers()), STOP_FOLLOWERS_S)
            except Exception as exc:  # the engine failed meanwhile: the followers are killed below
                log.warning("tensor-parallel followers not told to stop (%s)", exc)
        if self.engine_thread:
            self.engine_thread.stop()
            if self.engine_thread.core_turns is not None:  # a turn still held (a hung step) ends here
                self.engine_thread.core_turns.close()
        if self.ranks is not None:
            await asyncio.to_thread(self.ranks.stop)
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

    def role_context(self) -> RoleContext:
        """What the role modules get of this worker (its engine thread and KV endpoints built)."""
        engine = self.engine
        model = ModelShape(vocab_size=engine.model_config.vocab_size, block_size=engine.config.block_size,
                           block_nbytes=engine.kv_cache.block_nbytes, max_model_len=engine.scheduler.config.max_model_len,
                           device=engine.device, tensor_parallel_size=engine.tp.size)
        return RoleContext(config=self.config, model=model, engine=self.engine_thread,
                           on_kv_written=engine.runner.on_kv_written, kv_sender=self.kv_sender,
                           kv_receiver=self.kv_receiver, peers=self.peers, peer_http=self.http_client, auth=self.auth,
                           in_flight=self.in_flight, accepts=self.accepts, spawn=self.spawn, metrics=self.metrics,
                           ttft=self.ttft, tpot=self.tpot, reservation_lease_s=self.reservation_lease_s,
                           compile_grammar=self.compile_grammar, movable_streams=self.movable_streams,
                           exported=self.exported)

    async def compile_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """``params.structured`` compiled in the grammar compiler's threads (cached by spec)."""
        if params.structured is None:
            return None
        return await self.engine.grammars.compile_async(params.structured)

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
        has a transfer either (a handler stays in ``in_flight`` until its transfer has settled and
        its blocks are freed), so such an orphan is freed at once."""
        for request_id in request_ids:
            if not self.in_flight.cancel(request_id):
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

    # ---- admission, drain and role ---------------------------------------------------------

    def accepts(self, kind: str) -> tuple[str, str] | None:
        """Why a new ``kind`` ("generate", "prefill", "export": the KV of a stream handed over from
        here, taken while draining too, or "last_resort": a moved stream the gateway sends here
        because no active decode worker is left to continue it) request is refused now, or None.

        A draining or drained decode worker takes a last resort's stream (the worker a drain handed
        it to died): it decodes to its end here, and the drain waits for it (a drained worker
        drains again: its registry entry must not say idle while it decodes).  Not once the worker
        is shutting down.

        Returns ``(error_kind, reason)``: "refused" when the caller's view of this worker is stale
        (it drains, or its role changed), "busy" when it is simply full."""
        if self.failure is not None:
            return "refused", f"worker failed: {self.failure}"
        if kind == "export":  # a stream handed over from here: its KV, from this cache, in any role
            return self._full()
        last_resort = kind == "last_resort" and self.state in ("draining", "idle") and not self.shutting_down
        if self.state != "active" and not last_resort:
            return "refused", f"worker is {self.state}"
        wanted = ("decode", "both") if kind in ("generate", "last_resort") else ("prefill", "both")
        if self.role not in wanted:
            return "refused", f"worker role is {self.role}, not {' or '.join(wanted)}"
        refusal = self._full()
        if last_resort and refusal is None and self.state == "idle":
            self.begin_drain()  # (the stream is in flight before the drain's task first looks)
        return refusal

    def _full(self) -> tuple[str, str] | None:
        if len(self.in_flight) >= self.config.max_pending_requests:
            return "busy", f"worker has {len(self.in_flight)} requests in flight (limit {self.config.max_pending_requests})"
        return None

    def begin_drain(self) -> asyncio.Task:
        """Stop taking new requests now; the returned task finishes when nothing is in flight and
        the worker reports idle.  A role change before then cancels the drain (the worker is
        active again), so a late "idle" never parks a worker that was put back to work.

        Streams whose gateway can move them (``movable_streams``) are handed over at a token
        boundary, so the drain takes the time of a hand-over, not of the longest stream; the
        others decode to their end here -- as do all of them where no other decode worker is
        active to take them (this one was the last, or every one drains at once, as a stack that
        stops does; asked before they are told and again before they go).  First each is told it
        moves soon (a ``move_soon`` frame): while it keeps decoding, its gateway has the worker it
        will move to fetch the KV it has so far from this cache (a pre-copy, ``gateway.migration``).
        Once those calls have ended -- or ``control_timeout_s`` passed without one ending -- the
        streams are handed over, and each new worker fetches only the KV of the tokens since its
        pre-copy (or all of it, where there was none).  The drain waits for those calls too, at most ``control_timeout_s``
        for each to come."""
        self.state = "draining"
        if self._drain_task is None or self._drain_task.done():
            self._drain_task = self.spawn(self._finish_drain())
        return self._drain_task

    async def _finish_drain(self) -> None:
        # The registry says "draining" before any stream is handed over: a gateway that re-reads it
        # on the hand-over never routes the stream straight back here.
        await self._heartbeat.beat()
        if self.movable_streams and await self._another_decodes():
            self.precopies_due.update(self.engine_thread.announce_hand_over(self.movable_streams))
            await self._wait_for_precopies(self.config.control_timeout_s)
            handed = self.engine_thread.hand_over(self.movable_streams) if await self._another_decodes() else []
            if handed:
                log.info("drain: handing %d streams over to other decode workers", len(handed))
            self.exports_due.update(handed)
        elif self.movable_streams:
            log.info("drain: no other decode worker is active; its %d streams decode to their end here",
                     len(self.movable_streams))
        await self.in_flight.wait_idle()
        await self._wait_for_exports(self.config.control_timeout_s)
        await self.in_flight.wait_idle()
        if self.state == "draining":
            self.state = "idle"
            await self._heartbeat.beat()

    async def _another_decodes(self) -> bool:
        """Whether another decode worker of this model is active to take streams (False where the
        registry does not answer in time: they then decode to their end here)."""
        try:
            async with asyncio.timeout(self.config.control_timeout_s):
                active = await self.peers.registry.list_workers(self.engine.model_id, roles=("decode", "both"),
                                                                states=("active",))
        except (TimeoutError, *UNAVAILABLE_ERRORS) as exc:
            log.warning("drain: the registry did not answer (%s); streams decode to their end here",
                        type(exc).__name__)
            return False
        return any(w.worker_id != self.config.worker_id for w in active)

    def exported(self, stream_id: str) -> None:
        """A call for a stream's KV has ended (``RoleContext.exported``): its pre-copy if one is
        due, else the hand-over's."""
        if stream_id in self.precopies_due:
            self.precopies_due.discard(stream_id)
        else:
            self.exports_due.discard(stream_id)
        self._export_ended.set()

    async def _wait_for_precopies(self, timeout: float) -> None:
        """Until every stream told of its hand-over has had its KV pre-copied or has ended, or
        ``timeout`` seconds pass without a pre-copy ending (a gateway that does not pre-copy)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.precopies_due & self.movable_streams:
            if loop.time() >= deadline:
                log.info("drain: %d streams' KV not pre-copied; handing them over now", len(self.precopies_due))
                break
            self._export_ended.clear()
            try:  # short waits: a stream that ends here meanwhile sets no event
                await asyncio.wait_for(self._export_ended.wait(), STREAM_END_POLL_S)
                deadline = loop.time() + timeout
            except asyncio.TimeoutError:
                pass
        self.precopies_due.clear()

    async def _wait_for_exports(self, timeout: float) -> None:
        """Until every handed-over stream's KV has been fetched from here, or ``timeout`` seconds
        pass without one being asked for (its new worker computes it instead)."""
        while self.exports_due:
            self._export_ended.clear()
            try:
                await asyncio.wait_for(self._export_ended.wait(), timeout)
            except asyncio.TimeoutError:
                log.info("drain: %d handed-over streams' KV not asked for; not waiting longer", len(self.exports_due))
                self.exports_due.clear()

    async def wait_idle(self, timeout: float) -> None:
        """Wait until nothing is in flight, at most ``timeout`` seconds."""
        await self.in_flight.wait_idle(timeout)

    async def drain(self) -> None:
        """Shutting down: stop taking new requests for good, finish what is in flight, then report idle."""
        self.shutting_down = True
        await self.begin_drain()

    async def set_role(self, role: str) -> None:
        """Change what this worker accepts from now on; work in flight completes as it started.

        Leaving the decode pool: running streams keep decoding here until they finish (only new
        /generate calls are refused).  Leaving the prefill pool: prefills in flight finish and ship
        their KV.  The registry entry is rewritten at once, so the gateway routes by the new role
        on its next read.  Also the way back from a drain: the worker becomes active again."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
        if self.shutting_down:  # (its drain's end is the process's: it cut the streams a change let in)
            raise ShuttingDown("the worker is shutting down; its role stays until it exits")
        log.info("role change %s -> %s", self.role, role)
        self.role = role
        if self._drain_task is not None and not self._drain_task.done():
            self._drain_task.cancel()
        self.exports_due.clear()
        self.precopies_due.clear()
        if self.state in ("idle", "draining"):
            self.state = "active"
        await self._heartbeat.beat()

    def stats(self, engine_stats: dict | None = None) -> dict:
        """Counters for /stats: the engine's from its last snapshot (or ``engine_stats``)."""
        out = dict(self.engine_thread.snapshot if engine_stats is None else engine_stats)
        out.update(self.metrics.snapshot())
        out.update(worker_id=self.config.worker_id, role=self.role, state=self.state,
                   tensor_parallel_size=self.config.engine.tensor_parallel_size,
                   # one block of every rank: what a prompt block costs to receive
                   kv_bytes_per_block=sum(cache.block_nbytes for cache in self.engine.kv_shards.caches),
                   inflight=len(self.in_flight),
                   kv_incoming=self.kv_receiver.num_pending if self.kv_receiver else 0,
                   kv_outgoing=self.kv_sender.num_in_flight if self.kv_sender else 0,
                   kv_unauthenticated_ended=self.kv_receiver.unauthenticated_ended if self.kv_receiver else 0,
                   failed=None if self.failure is None else str(self.failure))
        out.update(listener_stats())  # KV accept errors survived, unauthenticated connections closed
        return out
