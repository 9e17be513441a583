"""Every HTTP port (gateway, workers) bounds what a client that sends nothing, or too little, can hold.

An in-process aiohttp app behind ``GuardedSite``, real sockets, under both event loops the services
run on.  Deadlines a test waits for are short (0.5 s) and waited for with a generous bound; a test
that must not see one sets them far beyond anything it waits for.
"""
from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
import uvloop
from aiohttp import web

from common.cluster.http_limits import HttpLimits
from common.cluster.http_listener import GuardedSite
from tests.waiting import until

BOUND = 60.0  # the most any wait here may take; a deadline of 0.5 s is waited for this long
SHORT = 0.5
NEVER = 3600.0
LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def run(loop: str, coro) -> None:
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        runner.run(asyncio.wait_for(coro, 4 * BOUND))


class App:
    """``/ok``; ``/hold`` streams a line, then waits for ``release``; ``/echo`` reads its body;
    ``/own-deadline`` bounds its own body read and answers a timeout its own way (as the gateway)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_get("/ok", self.ok)
        self.app.router.add_get("/hold", self.hold)
        self.app.router.add_post("/echo", self.echo)
        self.app.router.add_post("/own-deadline", self.own_deadline)

    async def ok(self, _request):
        return web.Response(text="ok")

    async def hold(self, request):
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"start\n")
        await self.release.wait()
        await response.write(b"end\n")
        return response

    async def echo(self, request):
        return web.Response(text=str(len(await request.read())))

    async def own_deadline(self, request):
        try:
            async with asyncio.timeout(NEVER):
                await request.read()
        except TimeoutError:
            return web.json_response({"error": "body too slow"}, status=408)
        return web.Response(text="read")


@contextlib.asynccontextmanager
async def serve(app: App, limits: HttpLimits):
    """Yields ``(port, open_connections)`` for ``app`` served as the services serve theirs."""
    runner = web.AppRunner(app.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = GuardedSite(runner, "127.0.0.1", 0, limits)
    await site.start()
    try:
        yield site.port, lambda: site.guard.num_open
    finally:
        app.release.set()
        await runner.cleanup()


async def until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection (bounded by ``BOUND``)."""
    return await asyncio.wait_for(reader.read(), BOUND)


def closed(reader: asyncio.StreamReader) -> bool:
    return reader.at_eof() or reader.exception() is not None


@pytest.mark.parametrize("loop", LOOPS)
def test_idle_connections_at_the_cap_make_room_for_a_client_and_busy_ones_are_never_cut(loop):
    """3 streams in progress + 1 connection that sent nothing fill a cap of 4: a new client is
    served (the idle one is closed for it); with 4 streams in progress the next one gets 503, and
    every stream runs to its end."""

    async def main():
        app = App()
        limits = HttpLimits(max_connections=4, header_timeout=NEVER, keepalive_timeout=NEVER, body_timeout=NEVER)
        async with serve(app, limits) as (port, open_connections), aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True)) as session:
            url = f"http://127.0.0.1:{port}"
            holds = []
            for _ in range(3):
                holds.append(await session.get(f"{url}/hold"))
                assert await holds[-1].content.readline() == b"start\n"
            idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
            await until(lambda: open_connections() == 4, "4 connections open", timeout=BOUND)
            async with session.get(f"{url}/ok") as answer:
                assert answer.status == 200 and await answer.text() == "ok"
            assert await until_closed(idle_reader) == b""
            holds.append(await session.get(f"{url}/hold"))
            assert await holds[-1].content.readline() == b"start\n"
            await until(lambda: open_connections() == 4, "4 streams open", timeout=BOUND)
            async with session.get(f"{url}/ok") as refused:
                assert refused.status == 503 and refused.headers["Retry-After"]
                assert (await refused.json())["error"]["code"] == "too_many_connections"
            app.release.set()
            for hold in holds:
                assert await asyncio.wait_for(hold.content.read(), BOUND) == b"end\n"
                hold.close()
            idle_writer.close()

    run(loop, main())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_connection_that_sends_nothing_is_closed_after_the_header_deadline(loop):
    async def main():
        limits = HttpLimits(header_timeout=SHORT, keepalive_timeout=NEVER, body_timeout=NEVER)
        async with serve(App(), limits) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert await until_closed(reader) == b""
            writer.close()

    run(loop, main())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_request_line_sent_a_byte_at_a_time_is_cut_off_at_the_header_deadline(loop):
    """Slowloris: bytes keep coming, the headers never complete; the deadline counts from the
    first byte, not the last: 408 and close."""

    async def main():
        limits = HttpLimits(header_timeout=SHORT, keepalive_timeout=NEVER, body_timeout=NEVER)
        async with serve(App(), limits) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /ok HTTP/1.1\r\nX-Slow: ")
            dripping = True

            async def drip():
                while dripping:
                    with contextlib.suppress(ConnectionError):
                        writer.write(b"a")
                    await asyncio.sleep(SHORT / 5)

            dripper = asyncio.create_task(drip())
            try:
                answer = await until_closed(reader)
            finally:
                dripping = False
                await dripper
            assert answer.startswith(b"HTTP/1.1 408 "), answer
            writer.close()

    run(loop, main())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_connection_idle_after_a_request_is_closed_after_the_keepalive(loop):
    async def main():
        limits = HttpLimits(header_timeout=NEVER, keepalive_timeout=SHORT, body_timeout=NEVER)
        async with serve(App(), limits) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /ok HTTP/1.1\r\nHost: test\r\n\r\n")
            answer = await until_closed(reader)  # kept alive, then closed by the server
            assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"ok"), answer
            writer.close()

    run(loop, main())


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("path, answer", [("/echo", b"HTTP/1.1 408 "), ("/own-deadline", b"HTTP/1.1 408 ")])
def test_a_body_that_does_not_arrive_in_time_ends_in_408(loop, path, answer):
    """A body announced as 100 bytes, 10 sent: the read fails at the body deadline (a handler that
    bounds its own read sees a ``TimeoutError`` and answers in its own format), then the
    connection is closed."""

    async def main():
        limits = HttpLimits(header_timeout=NEVER, keepalive_timeout=NEVER, body_timeout=SHORT)
        async with serve(App(), limits) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Length: 100\r\n\r\n".encode() + bytes(10))
            got = await until_closed(reader)
            assert got.startswith(answer), got
            if path == "/own-deadline":
                assert b"body too slow" in got
            writer.close()

    run(loop, main())
