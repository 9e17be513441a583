"""A TCP proxy whose bytes a test can hold (a peer that accepts and does not answer, then does)."""
from __future__ import annotations

import asyncio
import contextlib
import urllib.parse

from tests.support.loopback_server import LoopbackServer


class HoldableProxy(LoopbackServer):
    """A TCP proxy in front of Redis; ``hold()`` stops the bytes in both directions (nothing is
    lost or closed), ``release()`` lets them flow again."""

    def __init__(self, host: str, port: int):
        super().__init__()
        self.target = (host, port)
        self.flowing = asyncio.Event()
        self.flowing.set()

    def hold(self) -> None:
        self.flowing.clear()

    def release(self) -> None:
        self.flowing.set()

    async def _serve(self, reader, writer) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
            try:
                await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
            finally:
                up_writer.close()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _pump(self, reader, writer) -> None:
        while data := await reader.read(1 << 16):
            await self.flowing.wait()
            writer.write(data)
            await writer.drain()
        writer.close()


@contextlib.asynccontextmanager
async def proxied(redis_url: str):
    """A ``HoldableProxy`` in front of the Redis at ``redis_url``, its own URL as ``.url``."""
    url = urllib.parse.urlsplit(redis_url)
    async with HoldableProxy(url.hostname, url.port or 6379) as proxy:
        proxy.url = urllib.parse.urlunsplit((url.scheme, f"127.0.0.1:{proxy.port}", url.path, url.query, ""))
        yield proxy
