"""A discrete-event simulation of one deployment, driving the project's own scheduler and router.

What is real and what is modelled::

    real code, called as the services call it            modelled
    ---------------------------------------------        -------------------------------------------
    gateway.routing.Router.route (policy, pending,        the gateway's view: WorkerInfo refreshed
      gateway.decode_load.SentToDecode's pending_decode)
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
import heapq
import math
import time

import numpy as np

from common.cluster.registry import WorkerInfo
from common.engine.kv.kv_cache_manager import cdiv
from common.engine.request import Request
from common.engine.sampling_params import SamplingParams
from common.engine.request import status_after_token
from common.engine.step_log import step_shape
from gateway.backpressure import ADMITTED_WAKES
from gateway.decode_load import SentToDecode, computed_on, count_pending
from pdctl.planner.cost_model import CostModel
from pdctl.planner.metrics import certainly_failing, summarize_simulation
from pdctl.planner.sim_config import Deployment, HostEffects, SimConfig
from pdctl.planner.sim_worker import Job, SimWorker
from pdctl.planner.traffic import Workload, output_token
from gateway.routing import NoWorkerAvailable, Router

TOKEN = output_token()
STEP_END, KV_DONE, HEARTBEAT, REFRESH = range(4)


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
        self.costs: dict[str, CostModel] = {}  # each worker's step cost (its GPUs)
        for role, count, tag in (("prefill", deployment.prefill, "p"), ("decode", deployment.decode, "d"),
                                 ("both", deployment.both, "b")):
            for k in range(count):
                wid = f"{tag}{k}"
                tp = deployment.tp_of(role)
                self.workers[wid] = SimWorker(wid, role, config.settings_for(role, tp), clock=self._clock)
                self.costs[wid] = config.cost_for(tp)
        block_sizes = {w.settings.block_size for w in self.workers.values()}
        if len(block_sizes) != 1:
            raise ValueError(f"every worker must use the same block size, got {sorted(block_sizes)}")
        self.block_size = block_sizes.pop()
        # A prompt block's KV as it travels to a decode worker (a TP one receives every rank's heads).
        self.block_bytes = config.kv_bytes_per_token_for(deployment.tp_of("decode")) * self.block_size
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
                if cfg.stop_when_failing and arrived % check_every == 0 and certainly_failing(self, self.now):
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
        request_id, tokens = decode_request.request_id, decode_request.prompt_token_ids
        request = Request(request_id, tokens, SamplingParams(max_tokens=1, ignore_eos=True), arrival_time=now)
        request.hold_blocks_on_finish = True  # shipped after the prompt finishes, as the prefill role does
        try:
            prefill.scheduler.add_request(request)
        except ValueError as exc:
            count_pending(self.pending, prefill.worker_id, -pending)
            decode.scheduler.abort(request_id)
            if i in self.decode_of:  # refused after the gateway counted it as sent
                self.sent_to_decode.remove(self.decode_of.pop(i), request_id)
            self._fail(i, f"invalid: {exc}")
            return
        prefill.jobs[request_id] = Job(request, prefill, decode, num_cached // self.block_size, i, pending)
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
        duration = self.costs[w.worker_id].step_time(tokens, seqs, samples, pairs, context)
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
            request_id = request.request_id
            if request_id in jobs:
                continue  # a prefill for another worker: its first token travels with the KV
            i = int(request_id)
            if first[i] != first[i]:
                first[i] = now + self.config.overhead_s
                self.sent_to_decode.admitted(self.decode_of[i], request_id)
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
                self.sent_to_decode.remove(self.decode_of.pop(i), request_id)
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

    def _kv_done(self, job: Job, now: float) -> None:
        """The prompt's KV and its first token have reached the decode worker.  The first token
        goes out at once (unless it ends the request: then once it has landed); the request lands
        between two of the worker's steps."""
        decode = job.dest
        request = decode.scheduler.requests.get(job.request.request_id)
        if request is not None and status_after_token(request, TOKEN, decode.scheduler.config.max_model_len) is None:
            self._first_remote_token(job, now)
        self._between_steps(decode, lambda when: self._land(job, when))

    def _first_remote_token(self, job: Job, now: float) -> None:
        i = job.index
        # The gateway drops the prompt from its pending count when the first token arrives.
        count_pending(self.pending, job.source.worker_id, -job.pending)
        self.first_token[i] = now + self.config.overhead_s
        self.last_token[i] = now
        self.sent_to_decode.admitted(job.dest.worker_id, job.request.request_id)

    def _land(self, job: Job, now: float) -> None:
        decode = job.dest
        i = job.index
        request_id = job.request.request_id
        request = decode.scheduler.finish_remote(request_id, TOKEN)
        if request is None:
            if self.first_token[i] != self.first_token[i]:
                count_pending(self.pending, job.source.worker_id, -job.pending)
            self._fail(i, "aborted")
            self.sent_to_decode.remove(self.decode_of.pop(i), request_id)
            return
        if self.first_token[i] != self.first_token[i]:
            self._first_remote_token(job, now)
        self._kick(decode, now)
        if request.is_finished:
            self.finish[i] = now + self.config.overhead_s
            self.outcome[i] = "ok"
            self._remaining -= 1
            self.sent_to_decode.remove(self.decode_of.pop(i), request_id)
            if self.waiting:
                self._wake(1, now)

    # ---- results -----------------------------------------------------------------------------

    def _result(self, wall_s: float) -> dict:
        return summarize_simulation(self, wall_s)
