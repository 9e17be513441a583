"""A decode worker's real ``/generate`` in the test's own process, its prefill peer scripted.

The worker is a real ``Worker`` (not started: no Redis, no registry) with a real engine and
``EngineThread`` behind the real handler on a real HTTP socket; its KV receiver is whatever the
test gives (a real ``KVReceiver`` on a held in-process transport, or a stand-in).  The prefill
peer is ``harness.script(request) -> PrefillResult`` (raising is how a peer fails), so a test
decides exactly when the first token is known and what happens to the KV meanwhile::

    harness = await DecodeHarness(engine, receiver, monkeypatch).start()
    stream = harness.generate(prompt, max_tokens=8)      # frames read in the background
    ...
    await harness.stop()
"""
from __future__ import annotations

import asyncio
import time
import uuid
from types import SimpleNamespace
from typing import Awaitable, Callable

import aiohttp
from aiohttp import web

from common.cluster.messages import GenerateRequest, PrefillRequest, PrefillResult, TokenFrame, encode, read_frame
from common.engine.engine import Engine
from common.engine.sampling_params import SamplingParams
from worker.config import WorkerConfig
from worker.engine_thread import EngineThread
from worker.lifecycle import Worker
from decode_svc import generate, prefill_client
from decode_svc.role import DECODE
from kvtransfer.config import KVTransferConfig
from tests.support.waiting import until

WAIT = 120.0  # generous bound on anything a test waits for
PEER_ID = "p-scripted"


class Stream:
    """One /generate call, read frame by frame in the background."""

    def __init__(self, session: aiohttp.ClientSession, url: str, body: GenerateRequest):
        self.request_id = body.request_id
        self.frames: list[TokenFrame] = []
        self.first = asyncio.Event()
        self.task = asyncio.ensure_future(self._read(session, url, encode(body)))

    async def _read(self, session, url: str, data: bytes) -> list[TokenFrame]:
        async with session.post(url + "/generate", data=data) as resp:
            while (frame := await read_frame(resp.content, TokenFrame)) is not None:
                self.frames.append(frame)
                self.first.set()
                if frame.finished or frame.error:
                    break
        return self.frames

    async def tokens(self) -> list[int]:
        """Every token, once the stream has finished without an error."""
        frames = await asyncio.wait_for(self.task, WAIT)
        assert frames and frames[-1].finished, f"the stream ended unfinished: {frames}"
        errors = [f.error for f in frames if f.error]
        assert not errors, errors
        return [t for f in frames for t in f.token_ids]


class NoRegistry:
    """The heartbeat of a worker that has no registry entry."""

    async def beat(self) -> None:
        pass


class AnotherDecoder:
    """A registry that lists one more active decode worker: a drain here hands its streams over."""

    async def list_workers(self, model: str, *, roles=None, states=None) -> list:
        return [SimpleNamespace(worker_id="d-other", role="decode", state="active")]


class DecodeHarness:
    """See the module docstring.  ``clock``: the engine thread's lease clock."""

    def __init__(self, engine: Engine, receiver, monkeypatch, kv: KVTransferConfig | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.receiver = receiver
        self.kv = kv or KVTransferConfig(transport="tcp")
        self.clock = clock
        self.script: Callable[[PrefillRequest], Awaitable[PrefillResult]] | None = None
        self.aborts: list[str] = []  # request ids the decode worker told the peer to abort
        self.peer_listed = True  # the prefill peer's registry entry (False: it lapsed)
        self._monkeypatch = monkeypatch
        self.worker: Worker | None = None
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> "DecodeHarness":
        worker = Worker(WorkerConfig(engine=self.engine.config, kv=self.kv, role="decode"), [DECODE])
        worker.engine = self.engine
        worker.engine_thread = EngineThread(self.engine, asyncio.get_running_loop(), clock=self.clock)
        worker.engine_thread.on_lease_expired = worker._leases_expired  # as Worker.start wires it
        worker.engine_thread.on_fatal = worker._engine_failed
        worker.kv_receiver = self.receiver
        worker.peers = SimpleNamespace(forget=lambda worker_id: None, registry=AnotherDecoder(), get=self._peer)
        worker._heartbeat = NoRegistry()  # a drain or role change reports to nobody
        worker.state = "active"
        self.worker = worker

        async def resolve_prefill_worker(worker, worker_id, moved_stream=False):
            return await self._peer(worker_id)

        async def call_prefill(worker, peer, request):
            return await self.script(request)

        async def send_abort(worker, peer, request_id):
            self.aborts.append(request_id)

        self._monkeypatch.setattr(generate, "resolve_prefill_worker", resolve_prefill_worker)
        self._monkeypatch.setattr(prefill_client, "call_prefill", call_prefill)
        self._monkeypatch.setattr(generate, "send_abort", send_abort)
        worker.engine_thread.start()
        app = web.Application()
        DECODE.install(worker.role_context(), app)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self._session = aiohttp.ClientSession()
        return self

    async def _peer(self, worker_id: str):
        """The scripted prefill peer's registry entry, while ``peer_listed``."""
        return SimpleNamespace(worker_id=worker_id, instance="scripted", heartbeat_at=0.0, expires_at=5.0) \
            if self.peer_listed else None

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()
        for task in list(self.worker._background):
            task.cancel()
        self.worker.engine_thread.stop()

    def generate(self, prompt: list[int], max_tokens: int, remote: bool = True, **fields) -> Stream:
        """A greedy stream; ``fields``: more of ``GenerateRequest`` (``resume_token_ids``, ``may_migrate``)."""
        body = GenerateRequest(request_id=f"t-{uuid.uuid4().hex[:8]}", prompt_token_ids=prompt,
                               sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                               prefill_worker_id=PEER_ID if remote else None, **fields)
        return Stream(self._session, self.url, body)

    async def engine_state(self, fn: Callable[[Engine], object]):
        """``fn(engine)`` read in the engine thread, between two steps."""
        return await self.worker.engine_thread.call(fn)

    async def idle(self) -> None:
        """Until nothing is in flight and every block is free again."""
        async def done() -> bool:
            stats = await self.engine_state(lambda e: e.stats())
            return not self.worker.in_flight and stats["num_free_blocks"] == stats["num_blocks"]
        await until(done, "the decode worker to go idle with every block free")


