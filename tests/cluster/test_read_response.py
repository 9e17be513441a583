"""read_response reads a peer's body whole, refuses one above its limit, and gives up on a peer that
stalls after its headers -- against a real aiohttp server."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from common.cluster.messages import read_response


async def serve(handler):
    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}/"


async def chunked(request, parts: list[bytes], stall: float = 0.0):
    resp = web.StreamResponse()
    await resp.prepare(request)
    for part in parts:
        await resp.write(part)
        await asyncio.sleep(0.01)
    await asyncio.sleep(stall)
    await resp.write_eof()
    return resp


@pytest.mark.parametrize("parts, limit, expected", [
    ([b"a" * 1000] * 5, 5000, b"a" * 5000),  # whole, across chunks, exactly at the limit
    ([b"b" * 1000] * 6, 5000, ValueError),  # undeclared length, over the limit
])
async def test_whole_body_or_refused_above_the_limit(parts, limit, expected):
    async def handler(request):
        return await chunked(request, parts)

    runner, url = await serve(handler)
    try:
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            if expected is ValueError:
                with pytest.raises(ValueError, match="limit"):
                    await read_response(resp, limit)
            else:
                assert await read_response(resp, limit) == expected
    finally:
        await runner.cleanup()


async def test_a_peer_that_stalls_after_its_headers_times_out():
    async def handler(request):  # stalls well past the read's bound, not past the test's patience
        return await chunked(request, [b"partial"], stall=3)

    runner, url = await serve(handler)
    try:
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            with pytest.raises(asyncio.TimeoutError):
                await read_response(resp, 4096, timeout=0.5)
    finally:
        await runner.cleanup()
