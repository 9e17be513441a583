"""From a validated request to a stream of TokenFrames: route, call the decode worker, retry.

    prompt ids (+ model, cache_salt) -> block hashes -> Redis: cached prefix per worker (one round trip)
               -> Router: decode worker D, maybe prefill worker P
               -> POST D/generate {prompt, params, prefill_worker_id=P}   (D reserves, P fills)
               <- TokenFrame, TokenFrame, ...   (yielded in batches: every frame that has arrived)

Before the first token, a worker that fails is benched and the request is retried on another
(at most ``max_attempts`` failures); after it, the stream moves to another decode worker, which
continues after the tokens already sent (``gateway.migration``, at most ``migration_limit`` times;
a draining worker hands its streams over the same way), and beyond that ends with an explicit error.
An answer that is no frame stream (an error page from the worker's middleware, aiohttp or a
proxy; bytes that are no frames) is such a failure, never the client's: when no worker answers
readably the client gets 502 (``WorkerAnswerError``).
A worker that answers "busy" (it cannot reserve blocks) is skipped for this request; when no decode
worker is left to try, the request waits in the bounded, first-come-first-served ``WaitQueue``
(gateway/backpressure.py) and then tries again, or gets ``Saturated`` (503 + Retry-After).
Leaving early (client gone, stop string) closes the upstream stream and sends D an explicit
abort, which D forwards to P.

Every wait on D is bounded (``UpstreamTimeouts``)::

    connect ---- response (status + headers) ---- first frame ---- frame ---- frame ... finished
    `connect`    `response`                        `first_token`    `idle`    `idle`

A timeout before the first token benches D and retries elsewhere (a hung worker, accepting
connections and saying nothing, is taken out of routing); after it, the stream ends with an error.
Streams use a connection pool bounded by admission alone (``Gateway._client_sessions``); control
calls (aborts) have their own pool, of ``max_inflight``, and a total timeout: they never queue behind streams.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import aiohttp
import msgspec

from common.cluster.auth import ClusterAuth
from common.cluster.messages import (
    FRAMES_CONTENT_TYPE, AbortRequest, FrameReader, GenerateRequest, TokenFrame, encode, read_excerpt,
    read_response,
)
from common.engine.kv.prefix_hash import block_extra_keys, hash_prompt_blocks
from common.cluster.prefix_index import PrefixIndexReader
from common.engine.sampling_params import SamplingParams
from common.cluster.registry import WorkerInfo
from gateway.backpressure import KeyLineFull, Saturated, WaitQueue
from gateway.config import GatewayConfig, UpstreamTimeouts
from gateway.decode_load import SentToDecode, computed_on, count_pending
from gateway.metrics import GatewayMetrics
from gateway.openai_errors import Refused
from gateway.migration import StreamMigration
from gateway.pool import WorkerPool, can_decode
from gateway.routing import Route, Router
from gateway.upstream_errors import (  # (UpstreamError, WorkerAnswerError: imported from here too)
    BadAnswer, HandedOver, RetryElsewhere, UpstreamError, UpstreamTimeout, WorkerAnswerError, printable,
)
from gateway.upstream_watch import LeftWorkerWatch

log = logging.getLogger(__name__)

HASH_INLINE_BLOCKS = 256  # prompts with more full blocks are hashed off the event loop


# A decode worker answers /generate with frames, labelled FRAMES_CONTENT_TYPE: a stream (200) or
# one error frame (4xx/5xx).
BAD_ANSWER_EXCERPT = 256  # bytes of a bad answer's body kept for the log


@dataclass
class DispatchResult:
    """Facts about where a request ran, filled in as frames arrive."""

    route: Route | None = None
    attempts: int = 0


class Dispatcher:
    """Sends requests into the pools; one per gateway."""

    def __init__(self, pool: WorkerPool, router: Router, prefix_index: PrefixIndexReader,
                 session: aiohttp.ClientSession, control_session: aiohttp.ClientSession, metrics: GatewayMetrics,
                 model: str, *, timeouts: UpstreamTimeouts = UpstreamTimeouts(), queue: WaitQueue | None = None,
                 max_attempts: int = 3, auth: ClusterAuth | None = None,
                 migration_limit: int = GatewayConfig.migration_limit):
        self.pool = pool
        self.auth = auth or ClusterAuth.disabled()  # signs every call to a worker
        self.router = router
        self.prefix_index = prefix_index
        self.session = session  # streams from decode workers (no total timeout; see UpstreamTimeouts)
        self.control_session = control_session  # aborts: a total timeout per call
        self.metrics = metrics
        self.model = model
        self.timeouts = timeouts
        self.queue = queue or WaitQueue(GatewayConfig.queue_size, GatewayConfig.queue_timeout)
        metrics.requests_queued.set_function(lambda: self.queue.places_held)
        self.max_attempts = max_attempts  # failed attempts (not "busy" answers) before giving up
        self.migration_limit = migration_limit  # moves of one stream to another decode worker
        self._aborts: set[asyncio.Task] = set()
        # Prompt tokens this gateway sent to each worker to compute -- a prefill worker, or a
        # decode worker computing the prompt itself -- that have not produced their first token
        # yet: a load signal fresher than the workers' heartbeats (a colocated worker computing a
        # local prompt is not chosen to prefill the next one as if it were idle).
        self.pending_prefill: dict[str, int] = {}
        self.sent_to_decode = SentToDecode()
        self.left_watch = LeftWorkerWatch()  # cuts silent streams of workers gone from the registry
        pool.listeners.append(self._pool_changed)
        pool.listeners.append(self.left_watch.pool_changed)

    def _pool_changed(self, previous: Sequence[WorkerInfo], current: Sequence[WorkerInfo]) -> None:
        """New heartbeats: wake a waiting request to probe; a decode worker that joins: wake all."""
        before = {w.worker_id for w in previous if can_decode(w)}
        if any(can_decode(w) and w.worker_id not in before for w in current):
            self.queue.notify_all()
        else:
            self.queue.notify(1)

    async def choose(self, prompt: list[int], exclude: set[str], cache_salt: str | None = None,
                     hashed: dict[int, list[bytes]] | None = None, reads_cache: bool = True) -> Route | None:
        """A route avoiding ``exclude``, or None when no decode worker is left to try.  The prompt's
        block hashes are the ones the workers compute (same model id and ``cache_salt``);
        ``hashed`` keeps them per block size across the attempts of one request.  ``reads_cache``
        False: the request computes its prompt whole wherever it goes (it scores the prompt), so
        no worker's cached prefix counts."""
        workers = self.pool.routable(exclude)
        if not any(can_decode(w) for w in workers):
            return None
        block_size = workers[0].capacity.block_size
        hashed = {} if hashed is None else hashed
        if block_size not in hashed:
            hashed[block_size] = await self._hash(prompt, block_size, cache_salt)
        hashes = hashed[block_size]
        matched: dict[str, int] = {}
        if hashes and reads_cache:
            matched = await self.prefix_index.longest_prefix(self.model, hashes, [w.worker_id for w in workers])
        return self.router.route(workers, len(prompt), matched, affinity_key=hashes[0] if hashes else b"",
                                 pending=self.pending_prefill, pending_decode=self.sent_to_decode.load(workers))

    async def _hash(self, prompt: list[int], block_size: int, cache_salt: str | None) -> list[bytes]:
        """The prompt's block hashes; a long prompt is hashed in a thread, not on the event loop
        (a block costs microseconds: a 128k-token prompt would stall every stream ~0.1 s)."""
        extra_keys = block_extra_keys(self.model, cache_salt)
        if len(prompt) // block_size <= HASH_INLINE_BLOCKS:
            return hash_prompt_blocks(prompt, block_size, extra_keys)
        return await asyncio.to_thread(hash_prompt_blocks, prompt, block_size, extra_keys)

    def _sibling_route(self, follow: DispatchResult | None, exclude: set[str]) -> Route | None:
        """The decode worker ``follow`` ran on, computing the prompt there (it holds its blocks),
        if it is still routable and not excluded."""
        if follow is None or follow.route is None:
            return None
        return self._route_to(follow.route.decode, exclude, "sibling of an n > 1 request: the prompt is cached there")

    def _route_to(self, worker: WorkerInfo | None, exclude: set[str], reason: str) -> Route | None:
        """``worker`` computing the prompt itself, if it is still routable and not excluded."""
        worker = worker and next((w for w in self.pool.routable(exclude)
                                  if w.worker_id == worker.worker_id and can_decode(w)), None)
        if worker is None:
            return None
        return Route(decode=worker, prefill=None, decode_matched_tokens=0, prefill_matched_tokens=0, reason=reason)

    async def _precopy(self, request_id: str, prompt: list[int], params: SamplingParams, cache_salt: str | None,
                       sent: list[int], source: WorkerInfo, exclude: set[str]) -> WorkerInfo | None:
        """Copy the KV of a stream that ``source`` will hand over (``sent``: its tokens so far) to the
        worker it will move to, while it decodes on; returns that worker (``gateway.migration``)."""
        route = await self.choose(prompt + sent, exclude | {source.worker_id}, cache_salt)
        if route is None:
            return None
        fetched = len(sent) + 1  # the token after them ends it: the worker keeps the KV as cache
        body = GenerateRequest(
            request_id=f"{request_id[:100]}#precopy{len(sent)}", prompt_token_ids=prompt,
            sampling_params=msgspec.structs.replace(params, max_tokens=fetched, min_tokens=min(params.min_tokens, fetched),
                                                    prompt_logprobs=None),
            prefill_worker_id=source.worker_id, cache_salt=cache_salt, resume_token_ids=sent, precopy_of=request_id)
        resp = await self._open_stream(route.decode.http_address, body, route.decode.audience)
        try:
            await self._check_answer(resp, route.decode.worker_id)
            frames = FrameReader(resp.content, TokenFrame)
            while batch := await self._next_frames(resp, frames, first=True):
                if any(frame.error for frame in batch):
                    return None
                if any(frame.finished for frame in batch):
                    return route.decode
            return None  # the stream closed before its end
        finally:
            resp.close()

    def _count_pending(self, route: Route, prompt_len: int, sign: int) -> None:
        worker_id, tokens = computed_on(route, prompt_len)
        count_pending(self.pending_prefill, worker_id, sign * tokens)

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams, result: DispatchResult,
                       cache_salt: str | None = None, key_id: str | None = None,
                       follow: DispatchResult | None = None, choice_of: str | None = None
                       ) -> AsyncIterator[list[TokenFrame]]:
        """Frames of one request, in batches: each batch is what had arrived from the decode
        worker when it was read (one frame when the gateway keeps up), the last one ends with
        the finished frame.  Raises ``Saturated`` (no room anywhere within the queue's
        deadline; ``KeyLineFull`` when ``key_id`` holds its share of the wait queue),
        ``UpstreamError`` (failed in the cluster), ``ValueError`` (refused as invalid).
        ``cache_salt``: the request shares prefix-cache blocks only with requests of the same salt.
        ``follow``: another request's result (a sibling of an ``n > 1`` request, whose prompt is
        this one's): its decode worker, which caches the prompt, is tried first, computing it there.
        ``choice_of``: the request this is a choice of (its choices count once in the wait queue)."""
        exclude: set[str] = set()  # the runs of workers that failed this request (``WorkerInfo.audience``)
        stale: set[str] = set()  # workers that refused it as no longer decoding (until its stream moves)
        busy: set[str] = set()  # workers that said busy since this request last waited
        failures = 0
        last_bad_answer: BadAnswer | None = None  # the last worker answer that was no frame stream
        migration = StreamMigration(self.migration_limit, self.metrics)  # the tokens the client has
        hashed: dict[int, list[bytes]] = {}  # the prompt's block hashes, computed once
        place = self.queue.place(key_id, choice_of)  # its place in line while no decode worker has room (FIFO)
        waits = 0  # times it found no room (logged at the first, then at debug level: it looks twice a second)
        try:
            while True:
                try:
                    waited = await place.turn()
                except KeyLineFull:
                    self.metrics.key_refused(key_id)
                    raise
                if waited:  # it waited in line: room may have appeared anywhere, a refusal ended
                    busy.clear()
                    stale.clear()
                resume = list(migration.sent)  # a moved stream: the new worker computes these too
                if resume:
                    route = (self._route_to(migration.precopied_to, exclude | stale | busy, "pre-copied")
                             or await self.choose(prompt + resume, exclude | stale | busy, cache_salt))
                    route = route and migration.resumed_route(route)
                    if route is None and not busy and (spare := migration.last_resort(self.pool.routable(exclude | stale))):
                        route = Route(decode=spare, prefill=None, decode_matched_tokens=0, prefill_matched_tokens=0,
                                      reason="a moved stream's last resort: a draining decode worker")
                else:
                    scores = params.prompt_logprobs is not None  # computes its prompt whole: no cache to follow
                    route = (None if scores else self._sibling_route(follow, exclude | stale | busy)) or await self.choose(
                        prompt, exclude | stale | busy, cache_salt, hashed, reads_cache=not scores)
                if route is None and last_bad_answer is not None and not busy:
                    # Every worker left answered garbage: no room will appear by waiting.
                    raise WorkerAnswerError(f"no decode worker gave a readable answer ({last_bad_answer})")
                if route is None and not busy and (again := self.pool.decoding_runs(exclude)):
                    # Only runs that failed it are left (back from a stall past their registry entry's
                    # life): they may serve it (bounded by max_attempts and the migration limit) rather
                    # than it wait out the queue, and every request in line behind it with it.
                    exclude -= again
                    continue
                if route is None:
                    why = "every decode worker is busy" if busy else self.pool.why_no_decode_worker()
                    log.log(logging.DEBUG if waits else logging.INFO, "request %s waits for room (%s; %d in line)",
                            request_id, why, self.queue.places_held)
                    waits += 1
                    place.no_room(why)
                    continue
                result.attempts += 1
                result.route = route
                decode_id = route.decode.worker_id
                if route.prefill is None:
                    self.metrics.prefill_skipped.labels(route.reason).inc()
                # A moved stream's client has its prompt's logprobs already (from the first frame).
                body = GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params
                                       if not resume else msgspec.structs.replace(params, prompt_logprobs=None),
                                       prefill_worker_id=route.prefill.worker_id if route.prefill else None,
                                       cache_salt=cache_salt, resume_token_ids=resume,
                                       # (a last resort's worker drains: it must not hand the stream over again)
                                       last_resort=(last_resort := route.decode.state != "active"),
                                       may_migrate=migration.may_move and not last_resort)
                decode_url, audience = route.decode.http_address, route.decode.audience
                finished = said_busy = streamed = handed_over = False  # streamed: this attempt passed tokens on
                to_compute = len(prompt) + len(resume)
                self._count_pending(route, to_compute, +1)
                self.sent_to_decode.add(decode_id, request_id, -(-to_compute // route.decode.capacity.block_size))
                prompt_pending = True
                resp = watched = None
                try:
                    resp = await self._open_stream(decode_url, body, audience)
                    await self._check_answer(resp, decode_id)
                    watched = self.left_watch.watch(decode_id, resp)
                    if resp.status == 200:
                        place.admitted()  # D took it: its place in line goes to the next
                    frames = FrameReader(resp.content, TokenFrame)
                    got_frame = False  # (one that moves the stream soon is not one: the prompt may compute on)
                    while True:
                        watched.waiting()
                        batch = await self._next_frames(resp, frames, first=not got_frame)
                        got_frame = got_frame or not all(f.move_soon for f in batch)
                        if not batch:
                            raise ConnectionError("decode worker closed the stream before the request finished")
                        watched.heard()
                        ready: list[TokenFrame] = []
                        for frame in batch:
                            if frame.error:
                                if ready:  # what arrived before the error still reaches the client
                                    migration.passed_on(ready)
                                    yield ready
                                    ready = []
                                if frame.error_kind in ("busy", "refused") and not streamed:
                                    raise RetryElsewhere(frame.error, stale_view=frame.error_kind == "refused")
                                if frame.error_kind == "migrate":  # it drains: the stream goes on elsewhere
                                    raise HandedOver(frame.error)
                                if frame.error_kind == "invalid":
                                    raise Refused(frame.error, frame.error_param)
                                raise UpstreamError(frame.error)
                            if resp.status != 200:  # an error status must carry an error frame
                                raise BadAnswer(resp.status, resp.content_type, "a frame that is no error")
                            if frame.finish_reason == "error":  # ended with an error it did not name
                                raise UpstreamError(f"decode worker {decode_id} ended the request with an error")
                            if frame.move_soon:  # it drains: copy the stream's KV ahead to where it moves
                                migration.start_precopy(functools.partial(
                                    self._precopy, request_id, prompt, params, cache_salt, list(migration.sent),
                                    route.decode, exclude | stale | busy))
                                continue
                            if frame.token_ids:
                                streamed = True
                                self.sent_to_decode.admitted(decode_id, request_id)
                                if prompt_pending:
                                    self._count_pending(route, to_compute, -1)
                                    prompt_pending = False
                            ready.append(frame)
                            if frame.finished:
                                finished = True
                                break
                        migration.passed_on(ready)
                        yield ready
                        if finished:
                            return
                except HandedOver as exc:
                    # Draining: its entry says so (not excluded for good: it may be put back to work
                    # and take this stream again after another move).
                    handed_over = True  # (it ended the request there: no abort, which could land on its return)
                    await self.pool.refresh()
                    stale.clear()  # a worker that refused it before may be back at work by now,
                    busy.clear()  # and one busy when it started may have room
                    if migration.sent and not migration.move("drain", kv_source=route.decode):
                        raise UpstreamError(f"decode worker {decode_id} drained mid-stream: {exc}") from None
                    log.info("request %s: decode worker %s drains; the stream moves on after %d tokens",
                             request_id, decode_id, len(migration.sent))
                except RetryElsewhere as exc:
                    if not exc.stale_view:
                        said_busy = True
                        busy.add(decode_id)
                        self.metrics.decode_busy.labels(decode_id).inc()
                        continue
                    stale.add(decode_id)
                    await self.pool.refresh()  # it drains or changed role: re-read the registry
                except (aiohttp.ClientError, ConnectionError, UpstreamTimeout, BadAnswer) as exc:
                    if watched is not None and watched.cut:  # (what the cut made of the read is beside the point)
                        self.metrics.upstream_timeouts.labels("left").inc()
                        exc = ConnectionError("decode worker left the registry while its stream was silent")
                    exclude.add(route.decode.audience)  # (not its restart: a new run of the same worker)
                    if isinstance(exc, BadAnswer):
                        last_bad_answer = exc
                        log.warning("request %s: decode worker %s: %s", request_id, decode_id, exc.detail())
                    if not isinstance(exc, BadAnswer) or exc.worker_fault:
                        self.pool.bench(decode_id)  # unreachable, hung or broken: keep it out for a while
                    if streamed:
                        busy.clear()  # (when it started: long ago, perhaps)
                        if not migration.move("worker_lost"):
                            raise UpstreamError(f"decode worker {decode_id} failed mid-stream: {exc}") from None
                        log.warning("request %s: decode worker %s failed mid-stream (%s); the stream moves on after "
                                    "%d tokens", request_id, decode_id, exc, len(migration.sent))
                        continue
                    failures += 1
                    if failures >= self.max_attempts:
                        if isinstance(exc, BadAnswer):
                            raise WorkerAnswerError(f"no decode worker gave a readable answer after {failures} "
                                                    f"attempts ({exc})") from None
                        raise Saturated(f"no worker could take the request after {failures} failed attempts: {exc}")
                    log.warning("request %s: decode worker %s failed before the first token (%s); retrying",
                                request_id, decode_id, exc)
                finally:
                    self.left_watch.forget(watched)
                    if resp is not None:
                        # An unfinished stream is cut (which D notices at once); a finished one keeps
                        # its connection for the next request.
                        resp.release() if finished else resp.close()
                    if prompt_pending:
                        self._count_pending(route, to_compute, -1)
                    self.sent_to_decode.remove(decode_id, request_id)
                    if not said_busy:
                        self.queue.notify(1)  # a slot on D is free again: let a waiting request try
                    if not (finished or said_busy or handed_over):
                        # Client gone, stop string, or failure: make sure no worker keeps computing.
                        task = asyncio.get_running_loop().create_task(self.abort(decode_url, request_id, audience))
                        self._aborts.add(task)
                        task.add_done_callback(self._aborts.discard)
        finally:
            place.leave()
            migration.close()

    async def _open_stream(self, decode_url: str, body: GenerateRequest, audience: str) -> aiohttp.ClientResponse:
        """POST /generate (signed) and wait (bounded) for the status and headers."""
        data = encode(body)
        headers = self.auth.sign_request("POST", "/generate", data, audience=audience)
        try:
            async with asyncio.timeout(self.timeouts.response):
                return await self.session.post(f"{decode_url}/generate", data=data, headers=headers)
        except TimeoutError:
            raise self._timed_out("response", self.timeouts.response) from None

    async def _check_answer(self, resp: aiohttp.ClientResponse, decode_id: str) -> None:
        """Raise unless ``resp`` is a frame answer: ``ConnectionError`` for refused cluster
        credentials (401), ``BadAnswer`` for anything else that is no frame stream.  Of such a
        body only an excerpt is read, for the log, bounded in size and time (a page of any size, or
        a body that never ends, is still the worker's failure)."""
        if resp.status == 401:
            excerpt = await self._excerpt(resp)
            log.warning("decode worker %s refused the gateway's cluster credentials: %s", decode_id,
                        printable(excerpt) or "(no body)")
            raise ConnectionError("decode worker refused the cluster credentials; "
                                  "is PDSERVE_CLUSTER_SECRET the same on every process?")
        if resp.content_type == FRAMES_CONTENT_TYPE:
            return
        raise BadAnswer(resp.status, resp.content_type, "no frame stream", await self._excerpt(resp))

    async def _excerpt(self, resp: aiohttp.ClientResponse) -> bytes:
        """At most ``BAD_ANSWER_EXCERPT`` bytes of a body that is no frame stream, waiting at most
        the response timeout for them; what could not be read is left out."""
        try:
            return await read_excerpt(resp, BAD_ANSWER_EXCERPT, self.timeouts.response)
        except aiohttp.ClientError:
            return b""

    async def _next_frames(self, resp: aiohttp.ClientResponse, frames: FrameReader,
                           first: bool) -> list[TokenFrame]:
        """The frames that have arrived (``[]`` at the end of the stream), bounded by the
        first-token or the idle timeout; bytes that are no frames are a ``BadAnswer``."""
        phase, limit = ("first_token", self.timeouts.first_token) if first else ("idle", self.timeouts.idle)
        try:
            async with asyncio.timeout(limit):
                return await frames.next_batch()
        except TimeoutError:
            raise self._timed_out(phase, limit) from None
        except ValueError as exc:  # a header announcing too much, or a body that does not decode
            raise BadAnswer(resp.status, resp.content_type, f"malformed frames: {exc}") from None

    def _timed_out(self, phase: str, limit: float) -> "UpstreamTimeout":
        self.metrics.upstream_timeouts.labels(phase).inc()
        what = {"response": "did not answer", "first_token": "sent no token",
                "idle": "sent nothing more"}[phase]
        return UpstreamTimeout(f"decode worker {what} within {limit:g} s")

    async def drain(self) -> None:
        """Let the abort messages already sent finish (on shutdown)."""
        if self._aborts:
            await asyncio.wait(list(self._aborts), timeout=3)

    async def abort(self, decode_url: str, request_id: str, audience: str) -> None:
        data = encode(AbortRequest(request_id))
        headers = self.auth.sign_request("POST", "/abort", data, audience=audience)
        try:
            async with self.control_session.post(f"{decode_url}/abort", data=data, headers=headers) as resp:
                await read_response(resp, 4096)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            log.info("abort of %s on %s not delivered: %s: %s", request_id, decode_url, type(exc).__name__, exc)
