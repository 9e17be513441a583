"""A discrete-event simulation of one deployment, driving the project's own scheduler and router.

What is real and what is modelled::

    real code, called as the services call it            modelled
    ---------------------------------------------        -------------------------------------------
    gateway.routing.Router.route (policy, pending,        the gateway's view: WorkerInfo refreshed
      gateway.dispatch.SentToDecode's pending_decode)
                                                          per heartbeat, read every pool refresh
    gateway.backpressure.WaitQueue (size, deadline)       the gateway's dispatch loop around them
    Scheduler.add_request / reserve_remote /              step time: a CostModel of the step's shape
      schedule / update / finish_remote / release_held    KV transfer: bytes / link bandwidth,
    BlockPool + KVCacheManager (prefix cache, hashes,       serialised per sender and per receiver
      hits, eviction, preemption)                         HTTP hops: a fixed overhead per request
                                                          CPU hosts: workers slowing each other and
                                                            waking cold from idle (HostEffects)
                                                          a measured run's machine speed over time,
                                                            replayed (SpeedTrace; validation only)

Each worker steps only while it has work: a step is ``schedule()``, its duration from the cost
model, then ``update()`` at the step's end (event-driven, no global clock ticks).  A prefill
worker ships the blocks each step completed, as ``prefill_svc.shipping`` does.  What a worker's
event loop asks of its engine runs between two steps, as ``EngineThread.call`` runs it: a busy
decode worker starts a remote prefill (asks the prefill worker, after reserving the blocks) only
when its step in flight ends -- under load that wait is a large part of a remote prompt's TTFT.
The first token goes out as the KV arrives; the request joins the batch (``finish_remote``) when
the step in flight ends.  Requests are routed as
``gateway.dispatch`` routes them: prefix match per worker from its real block pool, the gateway's
count of pending prefill tokens.  A decode worker that is full (its pending-request limit, or no
room to reserve a remote prompt's blocks) answers "busy" and is skipped; with none left the
request waits in the gateway's ``WaitQueue`` -- woken oldest first when a stream ends or the pool
refreshes, each that gets room waking the next two, failed as saturated past its deadline or when
the queue is full -- as the gateway does.

Large clusters are sampled (``slice_for``): a slice of the workers with the same prefill:decode
ratio receives a matching share of the traffic, so each simulated worker sees the load it would
see in the whole cluster.  The result says when it was sampled and by how much.
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from common.cluster.registry import Capacity, KVAddress, Load, WorkerInfo
from common.engine.block_pool import BlockPool
from common.engine.config import SchedulerConfig
from common.engine.kv_cache_manager import KVCacheManager, cdiv
from common.engine.request import Request
from common.engine.sampling_params import SamplingParams
from common.engine.scheduler import Scheduler, status_after_token
from common.engine.step_log import step_shape
from gateway.backpressure import ADMITTED_WAKES
from gateway.config import GatewayConfig
from gateway.dispatch import SentToDecode, computed_on, count_pending
from gateway.planner.cost_model import CostModel
from gateway.planner.hardware import LinkProfile
from gateway.planner.traffic import Workload, output_token
from gateway.routing import NoWorkerAvailable, Router, RoutingConfig

TOKEN = output_token()
STEP_END, KV_DONE, HEARTBEAT, REFRESH = range(4)


@dataclass(frozen=True)
class Deployment:
    """How many workers of each role (one GPU each)."""

    prefill: int = 0
    decode: int = 0
    both: int = 0

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.both) < 0:
            raise ValueError(f"worker counts must be >= 0, got {self}")
        if self.decode + self.both < 1:
            raise ValueError("a deployment needs at least one decode or colocated worker")

    @property
    def gpus(self) -> int:
        return self.prefill + self.decode + self.both

    @property
    def label(self) -> str:
        parts = [f"{n}{tag}" for n, tag in ((self.prefill, "P"), (self.decode, "D"), (self.both, "C")) if n]
        return "+".join(parts)

    @property
    def colocated(self) -> bool:
        return self.prefill == 0 and self.decode == 0


@dataclass(frozen=True)
class EngineSettings:
    """One worker's engine, as its flags would set it (see ``common/worker/config.py``)."""

    num_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 4096
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    max_pending_requests: int = 256
    scheduler_options: tuple[tuple[str, Any], ...] = ()  # any other SchedulerConfig field

    def scheduler_config(self) -> SchedulerConfig:
        """Built by ``SchedulerConfig`` itself, so its validation and new knobs apply unchanged."""
        names = {f.name for f in dataclasses.fields(SchedulerConfig)}
        extra = dict(self.scheduler_options)
        unknown = sorted(set(extra) - names)
        if unknown:
            raise ValueError(f"unknown scheduler option(s) {unknown}; SchedulerConfig has {sorted(names)}")
        return SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
                               max_model_len=self.max_model_len, watermark=self.watermark, **extra)


@dataclass(frozen=True)
class HostEffects:
    """What workers sharing a host's CPUs do to their own and each other's step times (CPU
    serving; all 0 for GPU workers, each on its own GPU).

    - ``contention``: each other worker busy stepping when a step starts makes it this fraction
      slower (cores, memory bandwidth and the serving processes around the engines are shared);
    - ``decode_contention``: instead, for a decode-only step, each other worker mid decode-only
      step (None: ``contention``).  Two decode steps each stream every weight from memory, so
      they slow each other more than a step beside a prompt's compute-bound chunk does (on the
      2-vCPU validation host about 0.2 against 0.05);
    - ``wake_slowdown``: a worker that wakes from idle runs cold (caches refilled, clocks
      ramping) -- its steps in the first ``wake_window_s`` of work are this fraction slower after
      an idle of ``wake_full_s`` or longer, that share of it after a shorter one.

    Every simulated worker counts as on the one host (a CPU deployment on one machine).
    ``gateway.planner.calibrate.fit_host_effects`` fits them from probes of the real stack.
    """

    contention: float = 0.0
    wake_slowdown: float = 0.0
    wake_full_s: float = 2.0
    wake_window_s: float = 0.5
    decode_contention: float | None = None

    def __post_init__(self) -> None:
        if not (self.contention >= 0 and self.wake_slowdown >= 0 and self.wake_full_s > 0
                and self.wake_window_s >= 0 and (self.decode_contention is None or self.decode_contention >= 0)):
            raise ValueError(f"host effects must be >= 0 (wake_full_s > 0), got {self}")

    def step_time(self, seconds: float, other_busy: int, idle_before_s: float = 0.0, busy_for_s: float = 0.0,
                  decode_pairs: int = 0) -> float:
        """A step of ``seconds`` (the cost model's) beside ``other_busy`` busy workers, of which
        ``decode_pairs`` are mid decode-only step while this one is decode-only too, started
        ``busy_for_s`` into a busy period that followed ``idle_before_s`` of idle."""
        factor = 1.0 + self.contention * other_busy
        if decode_pairs and self.decode_contention is not None:
            factor += (self.decode_contention - self.contention) * decode_pairs
        if self.wake_slowdown and idle_before_s > 0 and busy_for_s < self.wake_window_s:
            factor += self.wake_slowdown * min(1.0, idle_before_s / self.wake_full_s)
        return seconds * factor


@dataclass(frozen=True)
class SpeedTrace:
    """The machine's speed over simulated time, replayed from a measured run
    (``gateway.planner.live.speed_trace``): from ``starts[k]`` seconds on, a step that computes
    prompt tokens takes ``prefill[k]`` times what the cost model says, a decode-only step
    ``decode[k]`` times.  Before ``starts[0]``, the first factors hold."""

    starts: tuple[float, ...]
    prefill: tuple[float, ...]
    decode: tuple[float, ...]

    def __post_init__(self) -> None:
        if not (len(self.starts) == len(self.prefill) == len(self.decode) > 0):
            raise ValueError("a speed trace needs as many prefill and decode factors as start times, at least one")
        if list(self.starts) != sorted(self.starts) or not all(f > 0 for f in (*self.prefill, *self.decode)):
            raise ValueError("a speed trace's start times must be sorted and its factors > 0")

    def factor(self, now: float, prefill: bool) -> float:
        k = max(0, bisect.bisect_right(self.starts, now) - 1)
        return self.prefill[k] if prefill else self.decode[k]


@dataclass(frozen=True)
class SimConfig:
    """Everything a simulation needs besides the deployment and the traffic."""

    cost: CostModel
    engine: EngineSettings
    prefill_engine: EngineSettings | None = None  # prefill workers' own settings (default: ``engine``)
    link: LinkProfile = LinkProfile("loopback", 2e9, 100e-6)
    kv_bytes_per_token: float = 131072.0
    routing: RoutingConfig = RoutingConfig()
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.1
    heartbeat_s: float = 5.0 / 3  # the worker's heartbeat: ttl / 3
    pool_refresh_s: float = 0.5  # the gateway re-reads the registry this often
    overhead_s: float = 0.0  # gateway + HTTP hops, added to TTFT and end-to-end latency
    host: HostEffects = HostEffects()  # workers sharing CPUs (all simulated workers on one host)
    speed: SpeedTrace | None = None  # the machine's speed over time, replayed from a run (validation)
    queue_size: int = GatewayConfig.queue_size  # the gateway's wait queue ...
    queue_timeout_s: float = GatewayConfig.queue_timeout  # ... and how long a request may wait in it
    drain_s: float | None = None  # simulated time after the last arrival (default: max(60, duration))
    stop_when_failing: bool = False  # stop as soon as the SLOs are certainly missed
    seed: int = 0

    def settings_for(self, role: str) -> EngineSettings:
        return self.prefill_engine if role == "prefill" and self.prefill_engine else self.engine


class _Job:
    """A prompt a worker prefills for another worker: what it has shipped so far."""

    __slots__ = ("request", "source", "dest", "next_index", "arrives", "index", "pending")

    def __init__(self, request: Request, source: "SimWorker", dest: "SimWorker", next_index: int, index: int,
                 pending: int):
        self.request = request
        self.source = source
        self.dest = dest
        self.next_index = next_index  # first block index not shipped yet (cached ones are skipped)
        self.arrives = 0.0  # when the last shipped byte lands
        self.index = index
        self.pending = pending  # prompt tokens the gateway counts as pending on the source


def _make_scheduler(config: SchedulerConfig, kv: KVCacheManager, clock) -> Scheduler:
    """A real ``Scheduler``; on simulated time where it takes a clock (reservation leases)."""
    if "clock" in inspect.signature(Scheduler).parameters:
        return Scheduler(config, kv, clock=clock)
    return Scheduler(config, kv)


class SimWorker:
    """One worker: a real ``Scheduler`` over a real ``BlockPool``, stepped by events."""

    def __init__(self, worker_id: str, role: str, settings: EngineSettings, clock=lambda: 0.0):
        self.worker_id = worker_id
        self.role = role
        self.settings = settings
        self.pool = BlockPool(settings.num_blocks, enable_caching=settings.enable_prefix_caching)
        self.scheduler = _make_scheduler(settings.scheduler_config(),
                                         KVCacheManager(self.pool, settings.block_size), clock)
        self.busy = False
        self.current = None  # the SchedulerOutput of the step in flight
        self.decoding = False  # the step in flight is decode-only
        self.jobs: dict[str, _Job] = {}
        self.between_steps: list = []  # the event loop's calls waiting for the step in flight to end
        self.link_out_free = 0.0
        self.link_in_free = 0.0
        self.last_step_end = -math.inf  # idle since ever: the first step wakes it
        self.idle_before = math.inf  # the idle that preceded the current busy period
        self.busy_since = 0.0
        # statistics
        self.busy_time = 0.0
        self.steps = 0
        self.prefill_tokens = 0
        self.usage_area = 0.0
        self.usage_peak = 0.0
        self.last_usage_time = 0.0
        self.preemptions = 0
        self._info = WorkerInfo(
            worker_id=worker_id, role=role, model="simulated", http_address=f"sim://{worker_id}",
            kv_address=KVAddress(transport="tcp", host="sim", port=1),
            capacity=Capacity(num_kv_blocks=settings.num_blocks, block_size=settings.block_size,
                              max_num_seqs=settings.max_num_seqs),
            state="active")
        self._rate_mark = (0.0, 0)
        self.info = self.heartbeat(0.0)

    def heartbeat(self, now: float) -> WorkerInfo:
        """This worker's registry entry now (what ``Worker.info`` reports)."""
        s = self.scheduler
        waiting_tokens = sum(r.num_tokens - r.num_computed_tokens for r in s.waiting) + sum(
            r.num_prompt_tokens - r.num_computed_tokens for r in s.running
            if r.num_computed_tokens < r.num_prompt_tokens)
        t0, c0 = self._rate_mark
        rate = (self.prefill_tokens - c0) / (now - t0) if now > t0 else 0.0
        self._rate_mark = (now, self.prefill_tokens)
        load = Load(num_waiting=len(s.waiting), num_running=len(s.running),
                    kv_usage=min(1.0, max(0.0, self.pool.usage)), num_waiting_prefill_tokens=waiting_tokens,
                    prefill_tokens_per_s=max(0.0, rate))
        self.info = msgspec.structs.replace(self._info, load=load, heartbeat_at=now)
        return self.info

    def note_usage(self, now: float) -> None:
        usage = self.pool.usage
        self.usage_area += usage * (now - self.last_usage_time)
        self.last_usage_time = now
        if usage > self.usage_peak:
            self.usage_peak = usage

    def cached_blocks(self, hashes: list[bytes]) -> int:
        """Leading blocks of a prompt this worker caches (what the Redis prefix index would say)."""
        cached = self.pool.cached
        n = 0
        for h in hashes:
            if h not in cached:
                break
            n += 1
        return n


class Simulation:
    """Runs one deployment against one workload; ``run()`` returns a ``SimResult`` dict."""

    def __init__(self, deployment: Deployment, workload: Workload, config: SimConfig, traffic_fraction: float = 1.0,
                 affinity_keys: list[bytes] | None = None):
        """``affinity_keys``: each request's key for the router's tie-break (the hash of its
        prompt's first block, as the gateway computes it from the real tokens), when the
        simulation replays a measured run; by default it comes from the workload's own tokens."""
        if affinity_keys is not None and len(affinity_keys) != len(workload):
            raise ValueError(f"{len(affinity_keys)} affinity keys for {len(workload)} requests")
        self.affinity_keys = affinity_keys
        self.deployment = deployment
        self.workload = workload
        self.config = config
        self.fraction = traffic_fraction
        self.router = Router(config.routing)
        self.now = 0.0
        self.workers: dict[str, SimWorker] = {}
        for role, count, tag in (("prefill", deployment.prefill, "p"), ("decode", deployment.decode, "d"),
                                 ("both", deployment.both, "b")):
            for k in range(count):
                wid = f"{tag}{k}"
                self.workers[wid] = SimWorker(wid, role, config.settings_for(role), clock=self._clock)
        block_sizes = {w.settings.block_size for w in self.workers.values()}
        if len(block_sizes) != 1:
            raise ValueError(f"every worker must use the same block size, got {sorted(block_sizes)}")
        self.block_size = block_sizes.pop()
        self.block_bytes = config.kv_bytes_per_token * self.block_size
        self.view: list[WorkerInfo] = [w.info for w in self.workers.values()]
        self.pending: dict[str, int] = {}  # the gateway's pending prompt tokens per computing worker
        self.local_pending: dict[int, tuple[str, int]] = {}  # of those, prompts computed where they decode
        self.sent_to_decode = SentToDecode(clock=self._clock)  # and its requests not in a heartbeat yet
        self.decode_of: dict[int, str] = {}  # request index -> the decode worker it was sent to
        self.events: list = []
        self._seq = 0
        n = len(workload)
        self.first_token = [math.nan] * n
        self.finish = [math.nan] * n
        self.last_token = [math.nan] * n
        self.outcome = [""] * n  # "" in flight, "ok", "error:<why>"
        self.route_kind = [""] * n
        self.computed_by = [""] * n  # the worker that computes each prompt
        self.itl_values: list[float] = []
        self.itl_weights: list[int] = []
        self.transfer_bytes = 0.0
        self.busy_workers = 0
        self.decoding_workers = 0  # workers mid decode-only step
        self.host = None if config.host == HostEffects() else config.host  # decided once, not per step
        self.retries = 0  # "busy" answers: a decode worker skipped for a request
        self.queued = 0  # requests that waited for room at least once
        # The gateway's WaitQueue: (deadline, request index), oldest deadline first; and what each
        # waiting request needs to be routed again.
        self.waiting: list[tuple[float, int]] = []
        self._wait_state: dict[int, tuple[Request, bytes]] = {}
        self.stopped_early = False

    def _clock(self) -> float:
        return self.now

    # ---- events ----------------------------------------------------------------------------

    def _push(self, when: float, kind: int, arg) -> None:
        self._seq += 1
        heapq.heappush(self.events, (when, self._seq, kind, arg))

    def run(self) -> dict:
        began = time.perf_counter()
        wl, cfg = self.workload, self.config
        rng = np.random.default_rng(cfg.seed)
        for w in self.workers.values():  # heartbeats are not in phase across workers
            self._push(float(rng.uniform(0, cfg.heartbeat_s)), HEARTBEAT, w)
        self._push(cfg.pool_refresh_s, REFRESH, None)
        drain = cfg.drain_s if cfg.drain_s is not None else max(60.0, wl.duration)
        horizon = wl.duration + drain
        self._remaining = len(wl)
        check_every = max(200, len(wl) // 50)
        arrivals = wl.arrival.tolist()  # already in order: merged with the heap, never pushed
        arrived = 0
        events = self.events
        while True:
            if arrived < len(arrivals) and (not events or arrivals[arrived] <= events[0][0]):
                self.now = arrivals[arrived]
                self._arrive(arrived, self.now)
                arrived += 1
                if cfg.stop_when_failing and arrived % check_every == 0 and self._certainly_failing(self.now):
                    self.stopped_early = True
                    break
                continue
            if not events or self._remaining == 0:
                break
            when, _, kind, arg = heapq.heappop(events)
            if when > horizon:
                break
            self.now = when
            if kind == STEP_END:
                self._end_step(arg, when)
            elif kind == KV_DONE:
                self._kv_done(arg, when)
            elif kind == HEARTBEAT:
                arg.heartbeat(when)
                self._push(when + cfg.heartbeat_s, HEARTBEAT, arg)
            elif kind == REFRESH:
                self.view = [w.info for w in self.workers.values()]
                self._push(when + cfg.pool_refresh_s, REFRESH, None)
                if self.waiting:
                    self._wake(1, when)  # new loads: one waiting request probes them
        for deadline, i in self.waiting:  # still waiting at the end: the gateway would give up
            self.outcome[i] = "error:saturated"
        self.waiting.clear()
        for w in self.workers.values():
            w.note_usage(self.now)
        return self._result(time.perf_counter() - began)

    def _certainly_failing(self, now: float) -> bool:
        """More than 10% of all requests already miss an SLO: the p90 cannot meet it any more."""
        cfg, wl = self.config, self.workload
        limit = 0.1 * len(wl)
        late = 0
        for i in range(len(wl)):
            arrival = wl.arrival[i]
            if arrival > now:
                break
            ft = self.first_token[i]
            if self.outcome[i].startswith("error") or (ft == ft and ft - arrival > cfg.slo_ttft_s) or (
                    ft != ft and now - arrival > cfg.slo_ttft_s):
                late += 1
            elif self.finish[i] == self.finish[i] and wl.output_len[i] > 1:
                if (self.finish[i] - ft) / (wl.output_len[i] - 1) > cfg.slo_tpot_s:
                    late += 1
        return late > limit

    # ---- routing and admission (gateway.dispatch + decode_svc.generate) -----------------------

    def _arrive(self, i: int, now: float) -> None:
        wl = self.workload
        tokens = wl.prompt_tokens(i)
        bs = self.block_size
        # The decode worker's own Request: its block hashes (the engine's hash function and extra
        # keys) serve the gateway's prefix lookup too, and are computed once.
        request = Request(str(i), tokens, SamplingParams(max_tokens=int(wl.output_len[i]), ignore_eos=True),
                          arrival_time=now)
        affinity = b""
        if len(tokens) >= bs:
            if wl.shared[i]:
                affinity = request.update_block_hashes(bs)[0]
            elif self.affinity_keys is None:  # nobody can hold a prompt no other request shares
                affinity = Request("affinity", tokens[:bs], request.sampling_params).update_block_hashes(bs)[0]
        if self.affinity_keys is not None:
            affinity = self.affinity_keys[i]
        if self.waiting:  # first come, first served: a newcomer queues behind every waiting request
            self._wait(i, request, affinity, now, None)
            return
        self._dispatch(i, request, affinity, now, None)

    def _dispatch(self, i: int, request: Request, affinity: bytes, now: float, deadline: float | None) -> str:
        """``gateway.dispatch.Dispatcher.generate`` up to the first token: look the prompt's prefix
        up, route; a decode worker that answers busy is skipped; with none left, wait
        (``deadline``: set when it first waited).  How it went: "admitted" (a decode worker took
        it), "refused" (as invalid: it leaves), "no room" (it waits, or failed as saturated)."""
        matched = {}
        if self.workload.shared[i] and request.num_prompt_tokens >= self.block_size:
            hashes = request.block_hashes
            for w in self.workers.values():
                m = w.cached_blocks(hashes)
                if m:
                    matched[w.worker_id] = m
        busy: set[str] = set()
        while True:
            workers = [w for w in self.view if w.worker_id not in busy] if busy else self.view
            try:
                route = self.router.route(workers, request.num_prompt_tokens, matched, affinity_key=affinity,
                                          pending=self.pending, pending_decode=self.sent_to_decode.load(workers))
            except NoWorkerAvailable:
                self._wait(i, request, affinity, now, deadline)
                return "no room"
            decode = self.workers[route.decode.worker_id]
            if decode.scheduler.num_unfinished < decode.settings.max_pending_requests and self._admit(
                    i, request, route, decode, now):
                if self.outcome[i] != "":
                    return "refused"
                self.decode_of[i] = decode.worker_id
                self.sent_to_decode.add(decode.worker_id, request.request_id,
                                        cdiv(request.num_prompt_tokens, decode.settings.block_size))
                return "admitted"
            busy.add(decode.worker_id)  # "busy": the gateway tries another decode worker
            self.retries += 1

    def _wait(self, i: int, request: Request, affinity: bytes, now: float, deadline: float | None) -> None:
        """``WaitQueue``: a request queues with a deadline and keeps its place (by arrival) until it
        leaves; a newcomer that finds the queue full, or a deadline passed, fails the request (503
        saturated).  A woken request that finds no room again still holds its place: no size check."""
        cfg = self.config
        full = False
        if deadline is None:
            deadline = now + cfg.queue_timeout_s
            self.queued += 1
            full = len(self.waiting) >= cfg.queue_size
        if full or deadline <= now:
            self._fail(i, "saturated")
            return
        bisect.insort(self.waiting, (deadline, i))
        self._wait_state[i] = (request, affinity)

    def _wake(self, n: int, now: float) -> None:
        """``WaitQueue.notify(n)``: the ``n`` oldest waiting requests try again; one whose deadline
        passed meanwhile has already failed (its wait timed out), and does not count.  Then, as
        ``Place.admitted`` and ``Place.leave`` do, each that got room wakes the next
        ``ADMITTED_WAKES`` and each refused as invalid passes its wake-up on, in rounds: the
        requests woken together all try before any answer counts (they try concurrently at the
        gateway), and one that found no room is back at its place for the next round's wake-ups.
        Tries take no time here, so the chain runs at once until a round admits nobody."""
        while n > 0 and self.waiting:
            woken = []
            while len(woken) < n and self.waiting:
                deadline, i = self.waiting.pop(0)
                request, affinity = self._wait_state.pop(i)
                if deadline <= now:
                    self._fail(i, "saturated")
                    continue
                woken.append((i, request, affinity, deadline))
            n = 0
            for i, request, affinity, deadline in woken:
                outcome = self._dispatch(i, request, affinity, now, deadline)
                n += ADMITTED_WAKES if outcome == "admitted" else 1 if outcome == "refused" else 0

    def _admit(self, i: int, request: Request, route, decode: SimWorker, now: float) -> bool:
        """``decode_svc.generate``: reserve blocks for a remote prefill, or queue the prompt locally.
        False when the decode worker answers busy (no room to reserve the prompt's blocks)."""
        try:
            if route.prefill is not None:
                reserved = decode.scheduler.reserve_remote(request)
                if reserved is None:
                    return False
                self._start_remote(i, request, route, decode, reserved[1])
                return True
            decode.scheduler.add_request(request)
            self.route_kind[i] = "local"
            worker_id, tokens = computed_on(route, request.num_prompt_tokens)
            self.computed_by[i] = worker_id
            count_pending(self.pending, worker_id, tokens)  # until its first token, as the gateway does
            self.local_pending[i] = (worker_id, tokens)
        except ValueError as exc:
            self._fail(i, f"invalid: {exc}")
            return True
        self._kick(decode, now)
        return True

    def _start_remote(self, i: int, decode_request: Request, route, decode: SimWorker, num_cached: int) -> None:
        """The gateway counts the prompt as pending on the prefill worker from now; the decode
        worker asks the prefill worker once its reservation has run, between two of its steps."""
        prefill = self.workers[route.prefill.worker_id]
        _, pending = computed_on(route, decode_request.num_prompt_tokens)
        count_pending(self.pending, prefill.worker_id, pending)
        self.route_kind[i] = "remote"
        self.computed_by[i] = prefill.worker_id
        self._between_steps(decode, lambda now: self._ask_prefill(i, decode_request, prefill, decode, num_cached,
                                                                  pending, now))

    def _ask_prefill(self, i: int, decode_request: Request, prefill: SimWorker, decode: SimWorker, num_cached: int,
                     pending: int, now: float) -> None:
        rid, tokens = decode_request.request_id, decode_request.prompt_token_ids
        request = Request(rid, tokens, SamplingParams(max_tokens=1, ignore_eos=True), arrival_time=now)
        request.hold_blocks_on_finish = True  # shipped after the prompt finishes, as the prefill role does
        try:
            prefill.scheduler.add_request(request)
        except ValueError as exc:
            count_pending(self.pending, prefill.worker_id, -pending)
            decode.scheduler.abort(rid)
            if i in self.decode_of:  # refused after the gateway counted it as sent
                self.sent_to_decode.remove(self.decode_of.pop(i), rid)
            self._fail(i, f"invalid: {exc}")
            return
        prefill.jobs[rid] = _Job(request, prefill, decode, num_cached // self.block_size, i, pending)
        self._kick(prefill, now)

    def _between_steps(self, w: SimWorker, call) -> None:
        """``EngineThread.call``: ``call(now)`` runs at once on an idle worker, else when its step
        in flight ends (before the next one is scheduled)."""
        if w.busy:
            w.between_steps.append(call)
        else:
            call(self.now)

    def _fail(self, i: int, why: str) -> None:
        self.outcome[i] = f"error:{why}"
        self._remaining -= 1

    # ---- stepping ----------------------------------------------------------------------------

    def _kick(self, w: SimWorker, now: float) -> None:
        if not w.busy:
            self._start_step(w, now)

    def _start_step(self, w: SimWorker, now: float) -> None:
        out = w.scheduler.schedule()
        if w.decoding:
            self.decoding_workers -= 1
            w.decoding = False
        if out.is_empty:
            if w.busy:
                self.busy_workers -= 1
            w.busy = False
            w.current = None
            return
        tokens, seqs, samples, pairs, context = step_shape(out.scheduled)
        duration = self.config.cost.step_time(tokens, seqs, samples, pairs, context)
        if not w.busy:  # a busy period begins
            self.busy_workers += 1
            w.idle_before = now - w.last_step_end
            w.busy_since = now
        decoding = tokens == seqs
        if self.host is not None:
            duration = self.host.step_time(duration, self.busy_workers - 1, w.idle_before, now - w.busy_since,
                                           self.decoding_workers if decoding else 0)
        if decoding:
            self.decoding_workers += 1
            w.decoding = True
        if self.config.speed is not None:
            duration *= self.config.speed.factor(now, not decoding)
        w.busy = True
        w.current = out
        w.busy_time += duration
        w.steps += 1
        w.prefill_tokens += tokens - sum(1 for s in out.scheduled if len(s.token_ids) == 1)
        if out.preempted_request_ids:
            w.preemptions += len(out.preempted_request_ids)
        self._push(now + duration, STEP_END, w)

    def _end_step(self, w: SimWorker, now: float) -> None:
        out = w.current
        sampled = {item.request_id: TOKEN for item in out.scheduled if item.sample}
        changed = w.scheduler.update(out, sampled)
        w.note_usage(now)
        first, last, finish = self.first_token, self.last_token, self.finish
        prev_end = w.last_step_end
        steady = ended = 0
        jobs = w.jobs
        for request in changed:
            rid = request.request_id
            if rid in jobs:
                continue  # a prefill for another worker: its first token travels with the KV
            i = int(rid)
            if first[i] != first[i]:
                first[i] = now + self.config.overhead_s
                self.sent_to_decode.admitted(self.decode_of[i], rid)
                if i in self.local_pending:
                    worker_id, tokens = self.local_pending.pop(i)
                    count_pending(self.pending, worker_id, -tokens)
            else:
                if last[i] == prev_end:
                    steady += 1
                else:
                    self.itl_values.append(now - last[i])
                    self.itl_weights.append(1)
            last[i] = now
            if request.is_finished:
                finish[i] = now + self.config.overhead_s
                self.outcome[i] = "ok"
                self._remaining -= 1
                self.sent_to_decode.remove(self.decode_of.pop(i), rid)
                ended += 1
        if steady:
            self.itl_values.append(now - prev_end)
            self.itl_weights.append(steady)
        if jobs:
            self._ship(w, out, now)
        w.last_step_end = now
        while w.between_steps:
            calls, w.between_steps = w.between_steps, []
            for call in calls:
                call(now)
        self._start_step(w, now)
        if ended and self.waiting:
            self._wake(ended, now)  # each stream that ended lets one waiting request try

    def _ship(self, w: SimWorker, out, now: float) -> None:
        """What ``prefill_svc.shipping.Shipper.after_step`` does: send every block this step completed."""
        bs = self.block_size
        link = self.config.link
        for item in out.scheduled:
            job = w.jobs.get(item.request_id)
            if job is None:
                continue
            request = job.request
            if request.is_finished:
                limit = cdiv(request.num_prompt_tokens, bs)
            else:
                limit = min(request.num_computed_tokens, request.num_prompt_tokens) // bs
            if limit > job.next_index:
                nbytes = (limit - job.next_index) * self.block_bytes
                start = max(now, w.link_out_free, job.dest.link_in_free)
                end = start + link.latency_s + nbytes / link.bandwidth
                w.link_out_free = job.dest.link_in_free = end
                job.next_index = limit
                job.arrives = end
                self.transfer_bytes += nbytes
            if request.is_finished:
                w.scheduler.release_held(request.request_id)
                del w.jobs[request.request_id]
                self._push(max(now, job.arrives), KV_DONE, job)

    def _kv_done(self, job: _Job, now: float) -> None:
        """The prompt's KV and its first token have reached the decode worker.  The first token
        goes out at once (unless it ends the request: then once it has landed); the request lands
        between two of the worker's steps."""
        decode = job.dest
        request = decode.scheduler.requests.get(job.request.request_id)
        if request is not None and status_after_token(request, TOKEN, decode.scheduler.config.max_model_len) is None:
            self._first_remote_token(job, now)
        self._between_steps(decode, lambda when: self._land(job, when))

    def _first_remote_token(self, job: _Job, now: float) -> None:
        i = job.index
        # The gateway drops the prompt from its pending count when the first token arrives.
        count_pending(self.pending, job.source.worker_id, -job.pending)
        self.first_token[i] = now + self.config.overhead_s
        self.last_token[i] = now
        self.sent_to_decode.admitted(job.dest.worker_id, job.request.request_id)

    def _land(self, job: _Job, now: float) -> None:
        decode = job.dest
        i = job.index
        rid = job.request.request_id
        request = decode.scheduler.finish_remote(rid, TOKEN)
        if request is None:
            if self.first_token[i] != self.first_token[i]:
                count_pending(self.pending, job.source.worker_id, -job.pending)
            self._fail(i, "aborted")
            self.sent_to_decode.remove(self.decode_of.pop(i), rid)
            return
        if self.first_token[i] != self.first_token[i]:
            self._first_remote_token(job, now)
        self._kick(decode, now)
        if request.is_finished:
            self.finish[i] = now + self.config.overhead_s
            self.outcome[i] = "ok"
            self._remaining -= 1
            self.sent_to_decode.remove(self.decode_of.pop(i), rid)
            if self.waiting:
                self._wake(1, now)

    # ---- results -----------------------------------------------------------------------------

    def _result(self, wall_s: float) -> dict:
        from gateway.planner.metrics import summarize_simulation

        return summarize_simulation(self, wall_s)
