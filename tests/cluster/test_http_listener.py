"""Every HTTP port (gateway, workers) bounds what a client that sends too little, or reads too little, can hold,
and answers a malformed request 400 without an error in its log.

An in-process aiohttp app behind ``GuardedSite``, real sockets, under both event loops the services
run on.  Deadlines a test waits for are short (0.5 s) and waited for with a generous bound; a test
that must not see one sets them far beyond anything it waits for.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import aiohttp
import psutil
import pytest
import uvloop
from aiohttp import web

from common.cluster.http_limits import HttpLimits
from common.cluster.http_listener import GuardedSite
from tests.support.waiting import until

pytestmark = pytest.mark.slow(seconds=21)  # a long file: scheduled by its length (tests/conftest.py)

BOUND = 60.0  # the most any wait here may take; a deadline of 0.5 s is waited for this long
SHORT = 0.5
NEVER = 3600.0
UNSENT = 48 << 10  # below the transports' 64 KiB high-water mark
BIG = 1 << 20  # far above what a shrunk socket and the transport's buffer hold
CUT_WITHIN = 256 << 20  # an unread body's bytes a client may get in before its connection is cut: four
# times the bound the server reads (64 MiB) with the sockets' buffers, far below ten seconds of loopback
LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def run(loop: str, coro) -> None:
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        runner.run(asyncio.wait_for(coro, 4 * BOUND))


class App:
    """``/ok``; ``/hold`` streams a line, then waits for ``release``; ``/echo`` reads its body;
    ``/own-deadline`` bounds its own body read and answers a timeout its own way (as the gateway);
    ``/shrink`` shrinks its connection's socket send buffer to a few KiB (as if the kernel's
    buffers were full: what a client does not read then stays in the transport's buffer) and
    answers ``ok``; ``/unsent`` does the same with an answer of ``UNSENT`` bytes, which stays
    mostly in that buffer (below its high-water mark: writing never pauses) until the client
    reads; ``/stream`` (with a shrunk socket too) writes each chunk put in ``chunks`` until
    ``None``."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.chunks: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.transports: list[asyncio.Transport] = []  # of /unsent and /stream, in order
        self.app = web.Application()
        self.app.router.add_get("/ok", self.ok)
        self.app.router.add_get("/hold", self.hold)
        self.app.router.add_post("/echo", self.echo)
        self.app.router.add_post("/own-deadline", self.own_deadline)
        self.app.router.add_get("/shrink", self.shrink)
        self.app.router.add_get("/unsent", self.unsent)
        self.app.router.add_get("/stream", self.stream)

    async def ok(self, _request):
        return web.Response(text="ok")

    async def hold(self, request):
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"start\n")
        await self.release.wait()
        await response.write(b"end\n")
        return response

    async def shrink(self, request):
        request.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        return web.Response(text="ok")

    async def unsent(self, request):
        await self.shrink(request)
        self.transports.append(request.transport)
        return web.Response(body=bytes(UNSENT))

    async def stream(self, request):
        await self.shrink(request)
        self.transports.append(request.transport)
        response = web.StreamResponse()
        await response.prepare(request)
        while (chunk := await self.chunks.get()) is not None:
            await response.write(chunk)
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
    """Yields the ``GuardedSite`` serving ``app`` as the services serve theirs."""
    runner = web.AppRunner(app.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = GuardedSite(runner, "127.0.0.1", 0, limits)
    await site.start()
    try:
        yield site
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
        async with serve(app, limits) as site, aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True)) as session:
            port, url = site.port, f"http://127.0.0.1:{site.port}"
            holds = []
            for _ in range(3):
                holds.append(await session.get(f"{url}/hold"))
                assert await holds[-1].content.readline() == b"start\n"
            idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
            await until(lambda: site.guard.num_open == 4, "4 connections open", timeout=BOUND)
            async with session.get(f"{url}/ok") as answer:
                assert answer.status == 200 and await answer.text() == "ok"
            assert await until_closed(idle_reader) == b""
            holds.append(await session.get(f"{url}/hold"))
            assert await holds[-1].content.readline() == b"start\n"
            await until(lambda: site.guard.num_open == 4, "4 streams open", timeout=BOUND)
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
def test_a_malformed_request_is_answered_in_json_with_its_status_counted_and_logged_without_a_traceback(loop, caplog):
    """A stranger's bad framing, too many or too long headers, a target too long: answered in the
    API's error shape with HTTP's status for the fault, its bytes not echoed, and never an error
    with a traceback in the log (a stranger could fill it with them)."""
    garbage = {b"GET /ok HTTP/1.1\r\nContent-Length: -5\r\n\r\n": (400, "malformed_request"),
               b"GET /ok HTTP/1.1\r\n" + b"".join(b"X-%d: a\r\n" % i for i in range(200)) + b"\r\n":
                   (431, "request_header_fields_too_large"),
               b"GET /ok HTTP/1.1\r\nX-Long: " + b"a" * 20000 + b"\r\n\r\n": (431, "request_header_fields_too_large"),
               b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n": (414, "uri_too_long"),
               b"POST /ok HTTP/1.1\r\nHost: x\r\nContent-Encoding: br\r\nContent-Length: 2\r\n\r\n{}":
                   (415, "unsupported_content_encoding")}

    async def main():
        limits = HttpLimits(header_timeout=NEVER, keepalive_timeout=NEVER, body_timeout=NEVER)
        async with serve(App(), limits) as site:
            for request, (status, code) in garbage.items():
                reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
                writer.write(request)
                head, _, body = (await until_closed(reader)).partition(b"\r\n\r\n")
                assert head.split(b" ")[1] == str(status).encode() and b"application/json" in head, head
                assert json.loads(body)["error"]["code"] == code and b"aaaa" not in body and b"-5" not in body
                assert status != 415 or "Content-Encoding brotli (br) is not" in json.loads(body)["error"]["message"]
                writer.close()
            assert site.stats["malformed"] == len(garbage)

    with caplog.at_level("DEBUG", logger="aiohttp.server"):
        run(loop, main())
    logged = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert len(logged) == len(garbage) and all(r.levelname == "DEBUG" and not r.exc_info for r in logged)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_connection_that_sends_nothing_is_closed_after_the_header_deadline(loop):
    async def main():
        limits = HttpLimits(header_timeout=SHORT, keepalive_timeout=NEVER, body_timeout=NEVER)
        async with serve(App(), limits) as site:
            reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
            assert await until_closed(reader) == b""
            writer.close()

    run(loop, main())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_request_line_sent_a_byte_at_a_time_is_cut_off_at_the_header_deadline(loop):
    """Slowloris: bytes keep coming, the headers never complete; the deadline counts from the
    first byte, not the last: 408 and close."""

    async def main():
        limits = HttpLimits(header_timeout=SHORT, keepalive_timeout=NEVER, body_timeout=NEVER)
        async with serve(App(), limits) as site:
            reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
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
        async with serve(App(), limits) as site:
            reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
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
        async with serve(App(), limits) as site:
            reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
            writer.write(f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Length: 100\r\n\r\n".encode() + bytes(10))
            got = await until_closed(reader)
            assert got.startswith(answer), got
            if path == "/own-deadline":
                assert b"body too slow" in got
            writer.close()

    run(loop, main())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_body_its_answer_left_unread_is_read_only_so_far_then_the_connection_is_cut(loop):
    """A refusal answers before reading its body (here a POST to ``/ok``, a GET route: 405, as a 401 or
    a 413 would): the answer arrives, then the server takes at most a bounded part of the rest before
    cutting the connection -- aiohttp alone read whatever came for ten seconds (gigabytes from a
    stranger over loopback)."""
    announced, chunk = 1 << 40, bytes(1 << 20)

    async def main():
        limits = HttpLimits(header_timeout=NEVER, keepalive_timeout=NEVER, body_timeout=NEVER)
        async with serve(App(), limits) as site:
            reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
            writer.write(f"POST /ok HTTP/1.1\r\nHost: test\r\nContent-Length: {announced}\r\n\r\n".encode())
            head = await asyncio.wait_for(reader.readuntil(b"405: Method Not Allowed"), BOUND)
            assert head.startswith(b"HTTP/1.1 405 "), head
            sent = 0
            with pytest.raises((ConnectionError, RuntimeError)):  # uvloop: its transport is closed
                while sent < CUT_WITHIN:
                    writer.write(chunk)
                    await asyncio.wait_for(writer.drain(), BOUND)
                    sent += len(chunk)
            assert site.stats["unread_body"] == 1
            writer.close()

    run(loop, main())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_connection_whose_answer_left_its_body_unread_serves_the_next_request_once_the_rest_arrives(loop):
    """A refusal's (405) small unread body: the rest is taken (so the answer is not cut off by a
    reset), and the connection goes on -- the answer did not say it would close, so a client may
    send its next request on it.  Before, the body's late bytes were taken for the next request's
    headers (and a 408 nobody asked for followed at the header deadline), then aiohttp ignored all
    that came after the answer and closed the connection ten seconds later."""

    async def main():
        limits = HttpLimits(header_timeout=SHORT, keepalive_timeout=NEVER, body_timeout=NEVER)
        async with serve(App(), limits) as site:
            reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
            writer.write(b"POST /ok HTTP/1.1\r\nHost: test\r\nContent-Length: 100\r\n\r\n" + bytes(10))
            head = await asyncio.wait_for(reader.readuntil(b"405: Method Not Allowed"), BOUND)
            assert head.startswith(b"HTTP/1.1 405 "), head
            await asyncio.sleep(2 * SHORT)  # past the header deadline
            writer.write(bytes(90))
            await asyncio.sleep(2 * SHORT)  # the body whole, the next request not begun: no deadline runs
            writer.write(b"GET /ok HTTP/1.1\r\nHost: test\r\n\r\n")
            answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\nok"), BOUND)
            assert answer.startswith(b"HTTP/1.1 200 "), answer
            # The body's last bytes and the next request in one piece, as a pipelining client sends them.
            writer.write(b"POST /ok HTTP/1.1\r\nHost: test\r\nContent-Length: 20\r\n\r\n")
            await asyncio.wait_for(reader.readuntil(b"405: Method Not Allowed"), BOUND)
            writer.write(bytes(20) + b"GET /ok HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
            answer = await until_closed(reader)
            assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"\r\n\r\nok"), answer
            assert site.stats.get("header_timeout", 0) == 0 and site.stats.get("unread_body", 0) == 0
            writer.close()

    run(loop, main())


@pytest.mark.parametrize("loop", LOOPS)
def test_after_an_unread_body_has_arrived_a_stalled_next_request_gets_the_header_deadline(loop):
    """Once the rest of the body is in, the connection is in keep-alive as after any answer: a later
    request whose headers stall is answered 408 at the header deadline (the lingering read's
    accounting does not swallow it).  (A request begun in the same read as the body's last bytes
    has the keep-alive deadline instead: where the body ends in them is the parser's to know.)"""

    async def main():
        limits = HttpLimits(header_timeout=SHORT, keepalive_timeout=NEVER, body_timeout=NEVER)
        async with serve(App(), limits) as site:
            reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
            writer.write(b"POST /ok HTTP/1.1\r\nHost: test\r\nContent-Length: 100\r\n\r\n" + bytes(10))
            await asyncio.wait_for(reader.readuntil(b"405: Method Not Allowed"), BOUND)
            writer.write(bytes(90) + b"GET /ok HTTP/1.1\r\nHost: test\r\n\r\n")
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\nok"), BOUND)
            writer.write(b"GET /ok HTTP/1.1\r\n")  # and no more
            assert (await until_closed(reader)).startswith(b"HTTP/1.1 408 ")
            assert site.stats["header_timeout"] == 1
            writer.close()

    run(loop, main())


def server_sockets(port: int) -> int:
    """This process's accepted sockets on ``port`` (its listening socket aside): counted by their
    local address, so a socket of another test closed meanwhile (by the garbage collector, say)
    cannot shift the count as it shifts the process's descriptor total."""
    return sum(1 for c in psutil.Process().net_connections(kind="tcp")
               if c.laddr and c.laddr.port == port and c.status != psutil.CONN_LISTEN)


async def connect_small_window(port: int) -> socket.socket:
    """A client socket with a tiny receive buffer: what it does not read stays on the server."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return sock


@pytest.mark.parametrize("loop", LOOPS)
def test_a_client_that_never_reads_its_answers_is_cut_off_at_the_write_deadline(loop):
    """The one connection a cap of 1 allows pipelines 10,000 requests and reads nothing: the answers
    (1.3 MB) fill what the sockets hold (a few KiB: ``/shrink``), writing pauses, and the connection
    stays busy with a request; at the write deadline it is aborted and counted, and a newcomer is
    served."""

    async def main():
        limits = HttpLimits(max_connections=1, header_timeout=NEVER, keepalive_timeout=NEVER, body_timeout=NEVER,
                            write_timeout=SHORT)
        async with serve(App(), limits) as site:
            sock = await connect_small_window(site.port)
            sending = asyncio.create_task(asyncio.get_running_loop().sock_sendall(
                sock, b"GET /shrink HTTP/1.1\r\nHost: t\r\n\r\n" + b"GET /ok HTTP/1.1\r\nHost: t\r\n\r\n" * 10_000))
            try:
                await until(lambda: site.stats.get("write_timeout") == 1, "the write deadline", timeout=BOUND)
                await until(lambda: site.guard.num_open == 0, "the connection's slot freed", timeout=BOUND)
                async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{site.port}/ok") as ok:
                    assert ok.status == 200 and await ok.text() == "ok"
            finally:
                sending.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await sending
                sock.close()

    run(loop, main())


WRITE_DEADLINE = 3.0  # each pause below lasts well under it; the second one spans the first one's deadline


@pytest.mark.parametrize("loop", LOOPS)
def test_a_client_that_reads_slowly_is_never_cut_off_and_the_deadline_restarts_with_each_pause(loop):
    """A stream writes far more than the sockets hold, twice, to a client that reads only once
    writing has paused: each pause lasts well under the write deadline, but the second one spans
    the deadline counted from the first.  The stream ends whole."""

    async def main():
        app = App()
        limits = HttpLimits(header_timeout=NEVER, keepalive_timeout=NEVER, body_timeout=NEVER,
                            write_timeout=WRITE_DEADLINE)
        async with serve(app, limits) as site:
            loop = asyncio.get_running_loop()
            reader, writer = await asyncio.open_connection(sock=await connect_small_window(site.port))
            writer.write(b"GET /stream HTTP/1.0\r\n\r\n")  # HTTP/1.0: the body as written, no chunk framing
            app.chunks.put_nowait(bytes(BIG))
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.0 200 ")
            await until(lambda: app.transports and app.transports[0].get_protocol().writing_paused, "writing paused",
                        timeout=BOUND)
            paused_at = loop.time()
            protocol = app.transports[0].get_protocol()
            assert await reader.readexactly(BIG) == bytes(BIG)
            await until(lambda: not protocol.writing_paused, "writing resumed", timeout=BOUND)
            await asyncio.sleep(paused_at + WRITE_DEADLINE / 2 - loop.time())
            app.chunks.put_nowait(bytes(BIG))
            await until(lambda: protocol.writing_paused, "writing paused again", timeout=BOUND)
            await asyncio.sleep(paused_at + WRITE_DEADLINE + SHORT / 2 - loop.time())  # past the first deadline
            assert await reader.readexactly(BIG) == bytes(BIG)
            app.chunks.put_nowait(b"end")
            app.chunks.put_nowait(None)
            assert await until_closed(reader) == b"end"
            assert not site.stats.get("write_timeout")
            writer.close()

    run(loop, main())


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("close", ["keepalive_timeout", "evicted"])
def test_a_connection_the_guard_closes_gives_its_socket_back_though_its_client_never_reads(loop, close):
    """Three clients that never read get an answer that stays in the transport's buffer; the
    guard then closes their connections (after the keep-alive, or for newcomers at the cap): the
    process holds no socket of theirs afterwards, once ``write_timeout`` has passed."""

    async def main():
        app = App()
        clients = 3
        limits = HttpLimits(max_connections=clients, header_timeout=NEVER, body_timeout=NEVER, write_timeout=SHORT,
                            keepalive_timeout=SHORT if close == "keepalive_timeout" else NEVER)
        async with serve(app, limits) as site:
            socks = [await connect_small_window(site.port) for _ in range(clients)]
            try:
                for sock in socks:
                    await asyncio.get_running_loop().sock_sendall(sock, b"GET /unsent HTTP/1.1\r\nHost: t\r\n\r\n")
                await until(lambda: len(app.transports) == clients and all(
                    0 < t.get_write_buffer_size() for t in app.transports), "answers left unsent", timeout=BOUND)
                if close == "evicted":  # each newcomer stays connected (idle): the next one evicts an older one
                    async with contextlib.AsyncExitStack() as newcomers:
                        for _ in range(clients):
                            session = await newcomers.enter_async_context(aiohttp.ClientSession())
                            async with session.get(f"http://127.0.0.1:{site.port}/ok") as ok:
                                assert ok.status == 200
                        await until(lambda: site.guard.num_open == clients, "the newcomers alone open", timeout=BOUND)
                await until(lambda: site.stats.get(close) == clients, f"{close} closes", timeout=BOUND)
                # Only the clients' own sockets are left (the newcomers have gone).
                await until(lambda: server_sockets(site.port) == 0, "the server's sockets closed",
                            timeout=BOUND)
                assert site.guard.num_open == 0
            finally:
                for sock in socks:
                    sock.close()

    run(loop, main())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_connection_being_closed_keeps_its_slot_until_a_newcomer_needs_it(loop):
    """A connection closed after the keep-alive whose client reads nothing stays counted while
    its answer waits to go out (its socket is still open); at the cap, a newcomer takes that slot
    at once."""

    async def main():
        limits = HttpLimits(max_connections=1, header_timeout=NEVER, body_timeout=NEVER, keepalive_timeout=SHORT,
                            write_timeout=NEVER)
        async with serve(App(), limits) as site:
            sock = await connect_small_window(site.port)
            try:
                await asyncio.get_running_loop().sock_sendall(sock, b"GET /unsent HTTP/1.1\r\nHost: t\r\n\r\n")
                await until(lambda: site.stats["closing"] == 1, "the keep-alive close", timeout=BOUND)
                assert site.stats["keepalive_timeout"] == 1 and site.guard.num_open == 1
                async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{site.port}/ok") as ok:
                    assert ok.status == 200 and await ok.text() == "ok"
                assert site.stats["closing"] == 0 and not site.stats.get("refused")
            finally:
                sock.close()

    run(loop, main())
