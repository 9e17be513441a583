"""Stand-ins for the gateway dispatcher's registry view: registry entries and a pool that routes
to them (unit tests of ``gateway.dispatch`` above the registry); and real aiohttp servers standing
in for decode workers, with a ``Dispatcher`` over them (``dispatcher``)."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import aiohttp
import msgspec
from aiohttp import web

from common.cluster.registry import Capacity, KVAddress, Load, WorkerInfo
from gateway.backpressure import WaitQueue
from gateway.config import UpstreamTimeouts
from gateway.dispatch import Dispatcher
from gateway.metrics import GatewayMetrics
from gateway.pool import WorkerPool
from gateway.routing import Router, RoutingConfig

BS = 16
MODEL = "org/model"


def worker(worker_id: str, role: str) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, state="active", model=MODEL,
                      http_address=f"http://{worker_id}:8000", kv_address=KVAddress("tcp", worker_id, 9000),
                      capacity=Capacity(num_kv_blocks=1000, block_size=BS, max_num_seqs=64), load=Load())


class Pool:
    """``WorkerPool``'s routing view over fixed workers; records benching; ``draining``: workers
    whose entries say they drain (the registry's view after a refresh)."""

    def __init__(self, workers):
        self.workers = workers
        self.listeners = []
        self.benched: list[str] = []
        self.draining: set[str] = set()

    def routable(self, exclude=()):
        return [msgspec.structs.replace(w, state="draining") if w.worker_id in self.draining else w for w in self.workers
                if w.worker_id not in exclude and w.audience not in exclude and w.worker_id not in self.benched]

    def decoding_runs(self, runs):
        return WorkerPool.decoding_runs(self, runs)

    def bench(self, worker_id):
        self.benched.append(worker_id)

    def why_no_decode_worker(self):
        listed = [msgspec.structs.replace(w, state="draining") if w.worker_id in self.draining else w
                  for w in self.workers]
        return WorkerPool.why_no_decode_worker(SimpleNamespace(workers=listed))

    async def refresh(self):
        pass


# ---- decode workers on real sockets ----------------------------------------------------------


async def aborted(request):
    return web.json_response({"aborted": True})


@contextlib.asynccontextmanager
async def worker_server(handler):
    """An aiohttp server answering ``/generate`` with ``handler`` (and ``/abort``); yields its URL."""
    app = web.Application()
    app.router.add_post("/generate", handler)
    app.router.add_post("/abort", aborted)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


def info(worker_id: str, url: str, running: int) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="decode", state="active", model="m", http_address=url,
                      kv_address=KVAddress("tcp", "127.0.0.1", 1), capacity=Capacity(1000, 16, 64),
                      load=Load(num_running=running))


class NoPrefixes:
    async def longest_prefix(self, model, hashes, worker_ids):
        return {}


@contextlib.asynccontextmanager
async def dispatcher(*handlers, timeouts: UpstreamTimeouts = UpstreamTimeouts(), **options):
    """A dispatcher over one worker per handler; the first is the least loaded (tried first)."""
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(worker_server(h)) for h in handlers]
        session = await stack.enter_async_context(aiohttp.ClientSession())
        pool = Pool([info(f"d{i}", url, running=i) for i, url in enumerate(urls)])
        d = Dispatcher(pool, Router(RoutingConfig()), NoPrefixes(), session, session, GatewayMetrics(), "m",
                       queue=WaitQueue(4, 60.0), timeouts=timeouts, **options)
        try:
            yield d
        finally:
            await d.drain()  # the aborts it sent, before the session closes
