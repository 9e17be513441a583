"""A TCP server on loopback for tests that play a peer: it tracks its connections' tasks, and
stops them all when it stops."""
from __future__ import annotations

import asyncio


class LoopbackServer:
    """``async with`` it: it listens on 127.0.0.1 (``port``) and serves each connection with
    ``_serve(reader, writer)`` (a subclass's), in a task it cancels when it stops."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._tracked, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.server.wait_closed()

    async def _tracked(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())
        try:
            await self._serve(reader, writer)
        finally:
            self._tasks.discard(asyncio.current_task())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError
