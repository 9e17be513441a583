"""The worker's auth middleware on a real aiohttp server (in process, raw sockets): everything the
signature covers is in the headers, so a caller without the cluster secret never gets a byte of its
body read; a verified request's body is read to exactly its signed length and must hash to the
signed SHA-256; a request not served after all gives its nonce back (issue 27 security review,
finding 1: a stranger with fresh, well-formed headers made a worker read 4 MiB before any check)."""
from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from common.cluster.auth import ClusterAuth
from worker.request_auth import cluster_auth_middleware
from tests.support.waiting import until

SECRET = "signed-body-test-secret-0123456789"
LIMIT = 4 << 20  # a worker's client_max_size (MAX_FRAME_BYTES)
HANG_S = 60  # turns a worker that waits for a body into a failure; never a claim about speed


class Worker:
    """One worker's HTTP app: the middleware in front of a handler that records what it read."""

    def __init__(self):
        self.verifier = ClusterAuth(SECRET).request_verifier("d0")
        self.served: list[bytes] = []
        self.refused: list[str] = []

    async def start(self) -> "Worker":
        async def handler(request: web.Request) -> web.Response:
            self.served.append(await request.read())
            return web.json_response({"ok": True})

        app = web.Application(client_max_size=LIMIT,
                              middlewares=[cluster_auth_middleware(self.verifier, self.refused.append)])
        app.router.add_post("/generate", handler)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    def sign(self, body: bytes, secret: str = SECRET) -> dict[str, str]:
        return ClusterAuth(secret).sign_request("POST", "/generate", body, audience=self.verifier.audience)

    async def send(self, headers: dict[str, str], content: bytes, *, length: int | None = None,
                   chunked: bool = False) -> tuple[int, dict]:
        """Send the request head with ``Content-Length: length`` (default: len(content)) and then
        ``content`` (all of it, or only a part of the declared body); the answer's status and JSON,
        read with the body possibly incomplete."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            length = len(content) if length is None else length
            framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}"
            head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            writer.write(f"POST /generate HTTP/1.1\r\nHost: x\r\n{head}{framing}\r\n\r\n".encode())
            if chunked:
                writer.write(f"{len(content):x}\r\n".encode() + content + b"\r\n0\r\n\r\n")
            else:
                writer.write(content)
            await writer.drain()
            async with asyncio.timeout(HANG_S):
                status_line = await reader.readline()
                answer_head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
                size = int(answer_head.split("content-length:")[1].split("\r\n")[0])
                return int(status_line.split()[1]), json.loads(await reader.readexactly(size))
        finally:
            writer.close()

    async def stop(self) -> None:
        await self.runner.cleanup()


@pytest.fixture
async def worker():
    w = await Worker().start()
    yield w
    await w.stop()


async def test_a_stranger_gets_a_401_before_any_body_is_read(worker):
    """Fresh, well-formed headers for this very worker, signed with another secret, declaring a
    4 MiB body of which only 1 KiB is sent: the 401 comes without waiting for the rest."""
    headers = worker.sign(b"x" * LIMIT, secret="a-stranger-secret-of-enough-length")
    status, answer = await worker.send(headers, b"x" * 1024, length=LIMIT)
    assert status == 401 and "wrong cluster credentials" in answer["error"]
    assert worker.served == [] and worker.refused == ["credentials"] and len(worker.verifier.seen) == 0


async def test_a_refusal_names_no_worker_id(worker):
    other = ClusterAuth(SECRET).request_verifier("p0")  # signed for another worker
    headers = ClusterAuth(SECRET).sign_request("POST", "/generate", b"{}", audience=other.audience)
    status, answer = await worker.send(headers, b"{}")
    assert status == 401 and worker.refused == ["audience"]
    assert "d0" not in answer["error"] and worker.verifier.instance not in answer["error"]
    assert "p0" not in answer["error"] and other.instance not in answer["error"]


async def test_a_body_that_is_not_the_signed_one_is_refused_and_uses_up_nothing(worker):
    body = b'{"request_id": "r1"}'
    headers = worker.sign(body)
    for sent in (b'{"request_id": "r2"}', body[:-1] + b" "):  # same length, another hash
        status, answer = await worker.send(headers, sent)
        assert status == 401 and "not the one" in answer["error"]
    for sent in (body + b" ", body[:-1], b""):  # another length: refused before the body is read
        status, answer = await worker.send(headers, sent)
        assert status == 401 and "Content-Length" in answer["error"]
    assert worker.served == [] and len(worker.verifier.seen) == 0
    assert (await worker.send(headers, body))[0] == 200  # the genuine request, once
    assert worker.served == [body]
    status, answer = await worker.send(headers, body)
    assert status == 401 and "replayed" in answer["error"] and worker.served == [body]


async def test_a_signed_body_over_the_limit_is_refused_unread(worker):
    headers = worker.sign(b"x" * (LIMIT + 1))
    status, answer = await worker.send(headers, b"", length=LIMIT + 1)  # no byte of it sent
    assert status == 413 and str(LIMIT) in answer["error"]
    assert worker.served == [] and len(worker.verifier.seen) == 0


async def test_a_signed_body_needs_a_content_length(worker):
    body = b'{"a": 1}'
    status, answer = await worker.send(worker.sign(body), body, chunked=True)
    assert status == 411 and "Content-Length" in answer["error"] and worker.served == []


async def test_a_caller_gone_before_its_body_arrived_gives_the_nonce_back(worker):
    """Verified headers (the nonce is taken), half the body, then the connection closes: nothing
    was served, so the nonce is given back and the same signed request, sent whole afterwards, is
    accepted once."""
    body = b"y" * 100_000
    headers = worker.sign(body)
    reader, writer = await asyncio.open_connection("127.0.0.1", worker.port)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(f"POST /generate HTTP/1.1\r\nHost: x\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode()
                 + body[:50_000])
    await writer.drain()
    await until(lambda: len(worker.verifier.seen) == 1, "the worker to verify the headers")
    writer.close()
    await until(lambda: len(worker.verifier.seen) == 0, "the nonce to be given back")
    assert worker.served == []
    assert (await worker.send(headers, body))[0] == 200 and worker.served == [body]
