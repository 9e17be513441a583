"""A stand-in decode worker for gateway tests: misbehaviour on demand (hang, busy, stall, flood).

A real worker cannot be made to hang before answering, to say "busy" on cue, or to stream faster
than any client reads; this one can.  It is a real aiohttp server on a real socket, registered in
the real Redis registry (with heartbeats) exactly as a decode worker registers, so the gateway under
test finds it, routes to it and talks to it over HTTP like to any worker (its entry signed with the
stack's cluster secret, as the gateway accepts no other).  It runs its own event loop in a thread, so
tests can drive the gateway with blocking clients.

Behaviours of ``POST /generate`` (``worker.behaviour``, changeable at any time):

    "stream"  stream ``max_tokens`` frames of one token each, then finish ("length")
    "hang"    accept the request and never answer (no status, no headers)
    "busy"    answer 503 with ``TokenFrame(error_kind="busy")``, as a worker that cannot reserve
    "invalid" answer 400 with ``TokenFrame(error_kind="invalid")``, as for input the engine rejects
    "stall"   send the response headers and one token, then nothing more
    "flood"   stream frames of ``flood_tokens`` tokens as fast as the gateway takes them, forever
    "trickle" like "stream", one frame every ``trickle_s`` seconds
"""
from __future__ import annotations

import asyncio
import threading
import time

from aiohttp import web

from common.cluster.auth import ClusterAuth
from common.cluster.messages import FRAMES_CONTENT_TYPE, AbortRequest, GenerateRequest, TokenFrame, decode, frame
from common.cluster.redis_util import connect
from common.cluster.registry import Capacity, Heartbeat, KVAddress, Load, WorkerInfo, WorkerRegistry

TOKEN_ID = 300  # any id inside the tiny test vocabulary


class FakeDecodeWorker:
    def __init__(self, redis_url: str, key_prefix: str, model: str, worker_id: str, behaviour: str = "stream",
                 *, max_num_seqs: int = 64, flood_tokens: int = 512, trickle_s: float = 0.25,
                 token_id: int = TOKEN_ID, cluster_secret: str | None = None, role: str = "decode") -> None:
        self.redis_url = redis_url
        self.key_prefix = key_prefix
        self.model = model
        self.worker_id = worker_id
        self.behaviour = behaviour
        self.role = role  # "both" also makes it count as a prefill-capable worker
        self.max_num_seqs = max_num_seqs
        self.flood_tokens = flood_tokens
        self.trickle_s = trickle_s
        self.token_id = token_id
        self.auth = ClusterAuth(cluster_secret)
        self.generate_calls: list[str] = []  # request ids, in arrival order
        self.aborts: list[str] = []
        self.open_streams = 0  # /generate handlers running now (its heartbeat reports them as running)
        self.peak_streams = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.url = ""

    # ---- lifecycle (called from the test's thread) ---------------------------------------------

    def start(self) -> "FakeDecodeWorker":
        self._thread = threading.Thread(target=self._main, name=f"fake-{self.worker_id}", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise TimeoutError("fake decode worker did not start")
        if self._error:
            raise self._error
        return self

    def stop(self) -> None:
        if self._loop and self._stop:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread:
            self._thread.join(30)

    def __enter__(self) -> "FakeDecodeWorker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_for(self, predicate, timeout: float = 30.0, what: str = "condition") -> None:
        """Poll ``predicate()`` (cheap, reads this object's counters) until true."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.worker_id}: timed out waiting for {what}")
            time.sleep(0.02)

    # ---- the worker ---------------------------------------------------------------------------

    def _main(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # surfaced by start()
            self._error = exc
            self._ready.set()
        finally:
            self._loop.close()

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            worker_id=self.worker_id, role=self.role, model=self.model, http_address=self.url,
            kv_address=KVAddress(transport="tcp", host="127.0.0.1", port=1),
            capacity=Capacity(num_kv_blocks=1024, block_size=4, max_num_seqs=self.max_num_seqs),
            state="active", load=Load(num_running=self.open_streams),
        )

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/abort", self._abort)
        app.router.add_get("/health", self._health)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        redis = connect(self.redis_url)
        heartbeat = Heartbeat(WorkerRegistry(redis, key_prefix=self.key_prefix, ttl_s=2.0, auth=self.auth), self.info)
        await heartbeat.start()
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await heartbeat.stop()
            await redis.aclose()
            await runner.cleanup()

    async def _health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _abort(self, request: web.Request) -> web.Response:
        body = decode(await request.read(), AbortRequest)
        self.aborts.append(body.request_id)
        return web.json_response({"aborted": True})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = decode(await request.read(), GenerateRequest)
        self.generate_calls.append(body.request_id)
        behaviour = self.behaviour
        if behaviour == "busy":
            return web.Response(status=503, body=frame(TokenFrame(error="no free KV blocks", error_kind="busy")),
                                content_type=FRAMES_CONTENT_TYPE)
        if behaviour == "invalid":
            return web.Response(status=400, body=frame(TokenFrame(error="prompt rejected by the engine",
                                                                  error_kind="invalid")),
                                content_type=FRAMES_CONTENT_TYPE)
        self.open_streams += 1
        self.peak_streams = max(self.peak_streams, self.open_streams)
        try:
            if behaviour == "hang":
                await asyncio.Future()  # until the gateway gives up and closes the connection
            response = web.StreamResponse(headers={"Content-Type": FRAMES_CONTENT_TYPE})
            await response.prepare(request)
            n = len(body.prompt_token_ids)
            if behaviour == "stall":
                await response.write(frame(TokenFrame(token_ids=[self.token_id], num_prompt_tokens=n)))
                await asyncio.Future()
            if behaviour == "flood":
                while True:
                    await response.write(frame(TokenFrame(token_ids=[self.token_id] * self.flood_tokens,
                                                          num_prompt_tokens=n)))
            max_tokens = body.sampling_params.max_tokens
            for i in range(max_tokens):
                if behaviour == "trickle" and i:
                    await asyncio.sleep(self.trickle_s)
                last = i == max_tokens - 1
                await response.write(frame(TokenFrame(token_ids=[self.token_id], num_prompt_tokens=n, finished=last,
                                                      finish_reason="length" if last else None)))
            return response
        finally:
            self.open_streams -= 1
