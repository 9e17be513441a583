"""/health's Redis probe (gateway/redis_probe.py): whatever Redis answers is an answer, never an
exception out of /health and never a stale "yes"; a "no" is kept a while too, so a Redis that fails
fast is not asked again by every /health call.

A fake server speaking just enough RESP stands in for a Redis that answers garbage or closes at
once (the test switches what it does and counts the PINGs); real Redis, with an ACL user that may
not PING, for a Redis that refuses the command.  The probe's clock is the test's."""
from __future__ import annotations

import asyncio
import contextlib
import uuid

import pytest
import redis

from common.cluster.redis_util import connect
from gateway.redis_probe import RedisProbe
from tests.support.loopback_server import LoopbackServer


class FakeRedis(LoopbackServer):
    """Answers ``+OK`` to the handshake; a PING with ``+PONG`` (``mode == "pong"``), with bytes that
    are no RESP (``"garbage"``), or by closing the connection (``"close"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.mode = "pong"
        self.pings = 0

    async def __aenter__(self) -> "FakeRedis":
        await super().__aenter__()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while command := await self._command(reader):
                if command[0].upper() != b"PING":
                    writer.write(b"+OK\r\n")
                    await writer.drain()
                    continue
                self.pings += 1
                if self.mode == "close":
                    break
                writer.write(b"+PONG\r\n" if self.mode == "pong" else b"HTTP/1.1 400 Bad Request\r\n\r\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _command(reader: asyncio.StreamReader) -> list[bytes] | None:
        header = await reader.readline()
        if not header:
            return None
        assert header.startswith(b"*"), header
        args = []
        for _ in range(int(header[1:])):
            size = int((await reader.readline())[1:])
            args.append((await reader.readexactly(size + 2))[:-2])
        return args


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextlib.asynccontextmanager
async def probe_of(url: str, clock: Clock, **kw):
    client = connect(url)
    probe = RedisProbe(client, clock=clock, **kw)
    try:
        yield probe
    finally:
        await probe.close()
        await client.aclose()


async def test_garbage_is_a_no_never_a_stale_yes_and_a_no_is_kept_a_while():
    clock = Clock()
    async with FakeRedis() as fake, probe_of(fake.url, clock, timeout_s=5.0, interval_s=10.0) as probe:
        assert await probe.answers() is True and fake.pings == 1
        clock.now += 10.0  # the "yes" is stale: the next call asks again
        fake.mode = "garbage"
        assert await probe.answers() is False  # an answer that is no RESP: not Redis, and not an exception
        pings = fake.pings
        assert await probe.answers() is False and fake.pings == pings  # the "no" is kept ...
        clock.now += 4.9
        assert await probe.answers() is False and fake.pings == pings
        clock.now += 0.1  # ... for min(timeout_s, interval_s)
        fake.mode = "pong"
        assert await probe.answers() is True and fake.pings == pings + 1


async def test_a_redis_that_closes_at_once_is_not_asked_by_every_call():
    clock = Clock()
    async with FakeRedis() as fake, probe_of(fake.url, clock, timeout_s=2.0, interval_s=0.5) as probe:
        fake.mode = "close"
        assert await probe.answers() is False
        pings = fake.pings
        assert pings >= 1
        for _ in range(5):
            assert await probe.answers() is False
        assert fake.pings == pings
        clock.now += 0.5  # min(timeout_s, interval_s)
        assert await probe.answers() is False and fake.pings > pings


@pytest.fixture
def user_without_ping(redis_url):
    """An ACL user of the real Redis that may run anything but PING."""
    admin = redis.Redis.from_url(redis_url)
    name, password = f"pdserve-noping-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    admin.acl_setuser(name, enabled=True, passwords=[f"+{password}"], keys=["*"], commands=["+@all", "-ping"])
    try:
        host, port = admin.connection_pool.connection_kwargs["host"], admin.connection_pool.connection_kwargs["port"]
        yield f"redis://{name}:{password}@{host}:{port}/0"
    finally:
        admin.acl_deluser(name)
        admin.close()


async def test_a_redis_that_refuses_ping_has_answered(user_without_ping):
    """NOPERM is Redis answering (as redis_util.ping takes it): a yes, not a 500 out of /health."""
    with pytest.raises(redis.exceptions.NoPermissionError):
        redis.Redis.from_url(user_without_ping).ping()  # the user is what the test needs
    clock = Clock()
    async with probe_of(user_without_ping, clock, timeout_s=2.0, interval_s=1.0) as probe:
        assert await probe.answers() is True
        clock.now += 1.0
        assert await probe.answers() is True
