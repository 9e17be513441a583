"""The gateway's listening socket, with a cap on open client connections.

aiohttp accepts every connection it is offered; each one costs a socket, buffers and a handler
task, whether or not it ever sends a request.  Beyond ``max_connections`` open connections a new
one is answered at once with ``503`` + ``Retry-After`` and closed, before anything is read from it.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Callable

from aiohttp import web

_REFUSAL_BODY = json.dumps({"error": {
    "message": "The server has too many open connections; retry shortly", "type": "service_unavailable_error",
    "param": None, "code": "too_many_connections"}}).encode()
_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: " + str(len(_REFUSAL_BODY)).encode() + b"\r\n\r\n" + _REFUSAL_BODY)


class _Refuse(asyncio.Protocol):
    def __init__(self, on_refused) -> None:
        self.on_refused = on_refused

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.on_refused()
        transport.write(_REFUSAL)
        transport.close()


class ConnectionCap:
    """The protocol factory: counts aiohttp's registered connections plus those accepted in the
    last moment and not registered yet (aiohttp registers one a loop iteration after the accept),
    so a burst of accepts cannot overshoot the cap."""

    def __init__(self, server: web.Server, max_connections: int, on_refused: Callable[[], None]):
        self.server = server
        self.max_connections = max_connections
        self.on_refused = on_refused
        self._accepted: list[tuple[float, web.RequestHandler]] = []  # not registered yet

    def __call__(self) -> asyncio.Protocol:
        now = time.monotonic()
        # A handler has a transport once registered; one still without after a second never will be.
        self._accepted = [(t, h) for t, h in self._accepted if h.transport is None and now - t < 1.0]
        if len(self.server.connections) + len(self._accepted) >= self.max_connections:
            return _Refuse(self.on_refused)
        handler = self.server()
        self._accepted.append((now, handler))
        return handler


async def listen(runner: web.AppRunner, host: str, port: int, max_connections: int,
                 on_refused: Callable[[], None] = lambda: None) -> asyncio.AbstractServer:
    """Serve ``runner``'s app on ``host:port``; close the returned server before ``runner.cleanup()``."""
    assert runner.server is not None, "listen() before runner.setup()"
    cap = ConnectionCap(runner.server, max_connections, on_refused)
    return await asyncio.get_running_loop().create_server(cap, host, port, reuse_address=True,
                                                          backlog=min(4096, max_connections))
