"""The gateway's connection pool for streams is not what bounds them (admission is): an admitted
request holds up to ``MAX_REQUEST_CHOICES`` streams, so a pool as large as ``max_inflight`` made
streams wait for a connection inside their response timeout -- and that wait benched a healthy
decode worker, failed attempts, and ended requests with 503.  The gateway's real sessions here,
against a decode worker on a real socket (tests/support/dispatch_stubs.py)."""
from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

from aiohttp import web

from common.cluster.messages import FRAMES_CONTENT_TYPE, GenerateRequest, TokenFrame, decode, frame
from common.engine.sampling_params import SamplingParams
from gateway.backpressure import WaitQueue
from gateway.config import GatewayConfig, UpstreamTimeouts
from gateway.dispatch import DispatchResult, Dispatcher
from gateway.metrics import GatewayMetrics
from gateway.routing import Router, RoutingConfig
from gateway.server import Gateway
from tests.support.dispatch_stubs import NoPrefixes, Pool, info, worker_server

STREAMS = 3  # one request's choices, say, with max_inflight 2


async def test_more_streams_than_max_inflight_take_no_healthy_worker_out():
    release = asyncio.Event()
    started = []

    async def decode_worker(request):  # answers at once, then holds every stream until all have started
        body = decode(await request.read(), GenerateRequest)
        response = web.StreamResponse(headers={"Content-Type": FRAMES_CONTENT_TYPE})
        await response.prepare(request)
        started.append(body.request_id)
        if len(started) == STREAMS:
            release.set()
        await release.wait()
        await response.write(frame(TokenFrame(token_ids=[5], finished=True, finish_reason="length")))
        return response

    async def one(d, request_id):
        async with contextlib.aclosing(d.generate(request_id, [1, 2, 3], SamplingParams(max_tokens=1),
                                                  DispatchResult())) as frames:
            return [t async for batch in frames for f in batch for t in f.token_ids]

    config = GatewayConfig(max_inflight=2, timeouts=UpstreamTimeouts(response=1.0))
    streams, control = Gateway._client_sessions(SimpleNamespace(config=config))
    try:
        async with worker_server(decode_worker) as url:
            pool = Pool([info("d0", url, running=0)])
            d = Dispatcher(pool, Router(RoutingConfig()), NoPrefixes(), streams, control, GatewayMetrics(), "m",
                           queue=WaitQueue(4, 60.0), timeouts=config.timeouts)
            results = await asyncio.gather(*(one(d, f"r{i}") for i in range(STREAMS)))
            await d.drain()
    finally:
        await streams.close()
        await control.close()
    assert results == [[5]] * STREAMS
    assert pool.benched == []
