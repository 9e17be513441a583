"""From a validated request to a stream of TokenFrames: route, call the decode worker, retry.

    prompt ids -> block hashes -> Redis: cached prefix per worker (one round trip)
               -> Router: decode worker D, maybe prefill worker P
               -> POST D/generate {prompt, params, prefill_url=P}   (D reserves, P fills)
               <- TokenFrame, TokenFrame, ...

Before the first token reaches the client, a busy or failed worker is benched and the request is
retried on another; after that, a failure ends the stream with an explicit error.  Leaving early
(client gone, stop string) closes the upstream stream and sends D an explicit abort, which D
forwards to P.

Every wait on D is bounded (``UpstreamTimeouts``)::

    connect ---- response (status + headers) ---- first frame ---- frame ---- frame ... finished
    `connect`    `response`                        `first_token`    `idle`    `idle`

A timeout before the first token benches D and retries elsewhere (a hung worker, accepting
connections and saying nothing, is taken out of routing); after it, the stream ends with an error.
Streams use a connection pool sized to the gateway's ``max_inflight``; control calls (aborts) have
their own pool of the same size and a total timeout, so they never queue behind streams.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator

import aiohttp

from common.cluster.auth import ClusterAuth
from common.cluster.messages import AbortRequest, GenerateRequest, TokenFrame, encode, read_frame, read_response
from common.engine.prefix_hash import hash_prompt_blocks
from common.cluster.prefix_index import PrefixIndexReader
from common.engine.sampling_params import SamplingParams
from gateway.config import UpstreamTimeouts
from gateway.metrics import GatewayMetrics
from gateway.pool import WorkerPool
from gateway.routing import NoWorkerAvailable, Route, Router

log = logging.getLogger(__name__)


class UpstreamError(Exception):
    """The request failed inside the cluster after it was accepted."""


class Saturated(Exception):
    """No worker can take the request now (the client gets 503 with Retry-After)."""


@dataclass
class DispatchResult:
    """Facts about where a request ran, filled in as frames arrive."""

    route: Route | None = None
    attempts: int = 0


class Dispatcher:
    """Sends requests into the pools; one per gateway."""

    def __init__(self, pool: WorkerPool, router: Router, prefix_index: PrefixIndexReader,
                 session: aiohttp.ClientSession, control_session: aiohttp.ClientSession, metrics: GatewayMetrics,
                 model: str, *, timeouts: UpstreamTimeouts = UpstreamTimeouts(), max_attempts: int = 3,
                 wait_for_workers_s: float = 2.0, auth: ClusterAuth | None = None):
        self.pool = pool
        self.auth = auth or ClusterAuth.disabled()  # signs every call to a worker
        self.router = router
        self.prefix_index = prefix_index
        self.session = session  # streams from decode workers (no total timeout; see UpstreamTimeouts)
        self.control_session = control_session  # aborts: a total timeout per call
        self.metrics = metrics
        self.model = model
        self.timeouts = timeouts
        self.max_attempts = max_attempts
        self.wait_for_workers_s = wait_for_workers_s
        self._aborts: set[asyncio.Task] = set()
        # Prompt tokens this gateway sent to each prefill worker that have not produced their
        # first token yet: a load signal fresher than the workers' heartbeats.
        self.pending_prefill: dict[str, int] = {}

    async def choose(self, prompt: list[int], exclude: set[str]) -> Route:
        workers = self.pool.routable(exclude)
        if not workers:
            await self.pool.wait_for_change(self.wait_for_workers_s)
            workers = self.pool.routable(exclude)
        matched: dict[str, int] = {}
        hashes = []
        if workers:
            block_size = workers[0].capacity.block_size
            hashes = hash_prompt_blocks(prompt, block_size)
            if hashes:
                matched = await self.prefix_index.longest_prefix(self.model, hashes, [w.worker_id for w in workers])
        try:
            return self.router.route(workers, len(prompt), matched, affinity_key=hashes[0] if hashes else b"",
                                     pending=self.pending_prefill)
        except NoWorkerAvailable as exc:
            raise Saturated(str(exc)) from None

    def _count_pending(self, route: Route, prompt_len: int, sign: int) -> None:
        if route.prefill is None:
            return
        wid = route.prefill.worker_id
        self.pending_prefill[wid] = self.pending_prefill.get(wid, 0) + sign * (prompt_len - route.prefill_matched_tokens)
        if self.pending_prefill[wid] <= 0:
            del self.pending_prefill[wid]

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       result: DispatchResult) -> AsyncIterator[TokenFrame]:
        exclude: set[str] = set()
        streamed = False
        while True:
            result.attempts += 1
            route = await self.choose(prompt, exclude)
            result.route = route
            if route.prefill is None:
                self.metrics.prefill_skipped.labels(route.reason).inc()
            body = GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params,
                                   prefill_url=route.prefill.http_address if route.prefill else None)
            decode_url = route.decode.http_address
            finished = False
            self._count_pending(route, len(prompt), +1)
            prefill_pending = route.prefill is not None
            resp = None
            try:
                resp = await self._open_stream(decode_url, body)
                if resp.status == 401:
                    reason = (await read_response(resp, 4096)).decode(errors="replace")
                    log.warning("decode worker %s refused the gateway's cluster credentials: %s",
                                route.decode.worker_id, reason)
                    raise ConnectionError(f"decode worker refused the cluster credentials ({reason}); "
                                          f"is PDSERVE_CLUSTER_SECRET the same on every process?")
                got_frame = False
                while True:
                    frame = await self._next_frame(resp, first=not got_frame)
                    got_frame = True
                    if frame is None:
                        raise ConnectionError("decode worker closed the stream before the request finished")
                    if frame.error:
                        if frame.error_kind in ("busy", "refused") and not streamed:
                            raise _Retry(frame.error, stale_view=frame.error_kind == "refused")
                        if frame.error_kind == "invalid":
                            raise ValueError(frame.error)
                        raise UpstreamError(frame.error)
                    if frame.token_ids:
                        streamed = True
                        if prefill_pending:
                            self._count_pending(route, len(prompt), -1)
                            prefill_pending = False
                    finished = frame.finished
                    yield frame
                    if finished:
                        return
            except (_Retry, aiohttp.ClientError, ConnectionError, _UpstreamTimeout) as exc:
                exclude.add(route.decode.worker_id)
                if not isinstance(exc, _Retry):
                    self.pool.bench(route.decode.worker_id)  # unreachable or hung: keep it out for a while
                elif exc.stale_view:
                    await self.pool.refresh()  # it drains or changed role: re-read the registry
                if streamed:
                    raise UpstreamError(f"decode worker {route.decode.worker_id} failed mid-stream: {exc}") from None
                if result.attempts >= self.max_attempts:
                    raise Saturated(f"no worker could take the request after {result.attempts} attempts: {exc}")
                log.warning("request %s: decode worker %s failed before the first token (%s); retrying",
                            request_id, route.decode.worker_id, exc)
            finally:
                if resp is not None:
                    # An unfinished stream is cut (which D notices at once); a finished one keeps
                    # its connection for the next request.
                    resp.release() if finished else resp.close()
                if prefill_pending:
                    self._count_pending(route, len(prompt), -1)
                if not finished:
                    # Client gone, stop string, or failure: make sure no worker keeps computing.
                    task = asyncio.get_running_loop().create_task(self.abort(decode_url, request_id))
                    self._aborts.add(task)
                    task.add_done_callback(self._aborts.discard)

    async def _open_stream(self, decode_url: str, body: GenerateRequest) -> aiohttp.ClientResponse:
        """POST /generate (signed) and wait (bounded) for the status and headers."""
        data = encode(body)
        headers = self.auth.sign_request("POST", "/generate", data)
        try:
            async with asyncio.timeout(self.timeouts.response):
                return await self.session.post(f"{decode_url}/generate", data=data, headers=headers)
        except TimeoutError:
            raise self._timed_out("response", self.timeouts.response) from None

    async def _next_frame(self, resp: aiohttp.ClientResponse, first: bool) -> TokenFrame | None:
        """The next frame of a stream, bounded by the first-token or the idle timeout."""
        phase, limit = ("first_token", self.timeouts.first_token) if first else ("idle", self.timeouts.idle)
        try:
            async with asyncio.timeout(limit):
                return await read_frame(resp.content, TokenFrame)
        except TimeoutError:
            raise self._timed_out(phase, limit) from None

    def _timed_out(self, phase: str, limit: float) -> "_UpstreamTimeout":
        self.metrics.upstream_timeouts.labels(phase).inc()
        what = {"response": "did not answer", "first_token": "sent no token",
                "idle": "sent nothing more"}[phase]
        return _UpstreamTimeout(f"decode worker {what} within {limit:g} s")

    async def drain(self) -> None:
        """Let the abort messages already sent finish (on shutdown)."""
        if self._aborts:
            await asyncio.wait(list(self._aborts), timeout=3)

    async def abort(self, decode_url: str, request_id: str) -> None:
        data = encode(AbortRequest(request_id))
        try:
            async with self.control_session.post(f"{decode_url}/abort", data=data,
                                                 headers=self.auth.sign_request("POST", "/abort", data)) as resp:
                await read_response(resp, 4096)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            log.info("abort of %s on %s not delivered: %s", request_id, decode_url, exc)


class _UpstreamTimeout(Exception):
    """A decode worker did not answer, or stopped sending, within its timeout."""


class _Retry(Exception):
    """The decode worker refused before starting; another one may take the request."""

    def __init__(self, reason: str, stale_view: bool):
        super().__init__(reason)
        self.stale_view = stale_view
