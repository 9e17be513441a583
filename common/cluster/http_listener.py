"""An HTTP listening socket that a stranger cannot fill with idle connections.

aiohttp accepts every connection it is offered and, by default, lets it sit for an hour without
sending a byte.  ``GuardedSite`` serves an ``AppRunner``'s app under ``HttpLimits``::

    accepted ──► waiting for headers ──(headers complete)──► busy ──(answered)──► keep-alive ──┐
                 closed after header_timeout                 never    closed after             │
                 (408 if it had sent a part)                 evicted  keepalive_timeout        │
                      ▲                                      body: must arrive within          │
                      └───────────────(first byte of the next request)──── body_timeout ◄──────┘

* At ``max_connections`` a newcomer makes room by closing the connection idle longest (waiting
  for headers or between requests); only when every connection is busy with a request is the
  newcomer answered ``503`` + ``Retry-After`` and closed, before anything is read from it.
* A request whose body has not arrived in full ``body_timeout`` after its headers: reads of it
  raise ``BodyTimeout`` (aiohttp answers 408; a handler bounding its own read sees a
  ``TimeoutError``), and the connection is closed once the request has been answered.

The states come from aiohttp's ``RequestHandler`` (a subclass here: ``_handle_request`` spans a
request from its complete headers to its answer, ``_messages`` holds parsed requests not yet
handled); ``_check_aiohttp`` refuses to start on an aiohttp without them, or with a name of its
own in the ``_g_`` namespace the subclass keeps its state in.
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import resource
import time
from typing import Callable

from aiohttp import web

from common.cluster.http_limits import HttpLimits

log = logging.getLogger(__name__)

_REFUSAL_BODY = json.dumps({"error": {
    "message": "The server has too many open connections; retry shortly", "type": "service_unavailable_error",
    "param": None, "code": "too_many_connections"}}).encode()
_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: " + str(len(_REFUSAL_BODY)).encode() + b"\r\n\r\n" + _REFUSAL_BODY)
_HEADER_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
_UNCONNECTED_S = 1.0  # a protocol without a transport after this long never gets one
_FD_RESERVE = 1024  # descriptors kept for everything but this listener's clients


class BodyTimeout(web.HTTPRequestTimeout, TimeoutError):
    """A request body that did not arrive within ``body_timeout``: a 408 to aiohttp, and a
    ``TimeoutError`` to a handler that bounds its own read (and answers in its own format)."""


def _check_aiohttp() -> None:
    handler_attrs = ("_handle_request", "_messages", "force_close")
    missing = [a for a in handler_attrs if not hasattr(web.RequestHandler, a)]
    clashing = [a for a in dir(web.RequestHandler) if a.startswith("_g_")]
    if missing or clashing:
        raise RuntimeError(f"this aiohttp's RequestHandler lacks {missing} or has {clashing}: "
                           "the connection guard cannot run")


class _Refuse(asyncio.Protocol):
    def __init__(self, on_refused: Callable[[], None]) -> None:
        self.on_refused = on_refused

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.on_refused()
        transport.write(_REFUSAL)
        transport.close()


class _GuardedHandler(web.RequestHandler):
    """aiohttp's protocol for one connection, with the deadlines of its state (module docstring)."""

    def __init__(self, guard: "ConnectionGuard", **kwargs):
        super().__init__(guard.server, loop=guard.loop, **kwargs)
        self._g_guard = guard
        self._g_deadline: asyncio.TimerHandle | None = None
        self._g_busy = False  # a request's headers are complete and it is not answered yet
        self._g_waiting_headers = True  # idle kind: False while between requests (keep-alive)
        self._g_partial = False  # bytes of the next request's headers arrived
        self._g_body_overdue = False
        self._g_gone = False  # closed by the guard, or lost

    # -- asyncio protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._g_guard._connected(self)
        self._g_become_idle(waiting_headers=True)

    def data_received(self, data: bytes) -> None:
        if not self._g_busy and data and not self._g_partial:
            self._g_partial = True
            if not self._g_waiting_headers:  # a new request begins: its headers have header_timeout
                self._g_become_idle(waiting_headers=True, partial=True)
        super().data_received(data)
        if not self._g_busy and self._messages:  # a whole request (headers) arrived
            self._g_become_busy()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._g_leave()
        super().connection_lost(exc)

    # -- requests ----------------------------------------------------------------------------

    async def _handle_request(self, request: web.BaseRequest, *args, **kwargs):
        self._g_become_busy()
        timer = None
        if not request.content.is_eof():
            timer = self._loop.call_later(self._g_guard.limits.body_timeout, self._g_body_deadline, request)
        try:
            return await super()._handle_request(request, *args, **kwargs)
        finally:
            if timer is not None:
                timer.cancel()
            if self._g_body_overdue:
                self._g_close("body_timeout")
            elif not self._messages and not self._g_gone:
                self._g_become_idle(waiting_headers=False)

    def _g_body_deadline(self, request: web.BaseRequest) -> None:
        if request.content.is_eof() or self._g_gone:
            return
        self._g_body_overdue = True
        seconds = self._g_guard.limits.body_timeout
        request.content.set_exception(BodyTimeout(text=f"the request body did not arrive within {seconds:g} s"))

    # -- states ------------------------------------------------------------------------------

    def _g_become_busy(self) -> None:
        if self._g_busy or self._g_gone:
            return
        self._g_busy = True
        self._g_cancel_deadline()
        self._g_guard._idle.pop(self, None)

    def _g_become_idle(self, waiting_headers: bool, partial: bool = False) -> None:
        if self._g_gone:
            return
        self._g_busy, self._g_waiting_headers, self._g_partial = False, waiting_headers, partial
        limits = self._g_guard.limits
        self._g_cancel_deadline()
        delay = limits.header_timeout if waiting_headers else limits.keepalive_timeout
        self._g_deadline = self._loop.call_later(delay, self._g_deadline_passed)
        self._g_guard._idle.pop(self, None)
        self._g_guard._idle[self] = None  # the most recently idle last: evicted last

    def _g_deadline_passed(self) -> None:
        self._g_deadline = None
        if self._g_busy or self._g_gone:
            return
        if self._g_waiting_headers:
            if self._g_partial and self.transport is not None:
                self.transport.write(_HEADER_TIMEOUT)
            self._g_close("header_timeout")
        else:
            self._g_close("keepalive_timeout")

    def _g_cancel_deadline(self) -> None:
        if self._g_deadline is not None:
            self._g_deadline.cancel()
            self._g_deadline = None

    def _g_close(self, why: str) -> None:
        """Close this connection now (after what is already written goes out)."""
        if self._g_gone:
            return
        self._g_guard.stats[why] += 1
        self._g_leave()
        self.force_close()

    def _g_leave(self) -> None:
        self._g_gone = True
        self._g_cancel_deadline()
        self._g_guard._forget(self)


class ConnectionGuard:
    """The listening socket's protocol factory: counts every connection from its accept (aiohttp
    registers one only a loop iteration later, so a burst of accepts cannot overshoot the cap)
    and makes room at the cap by closing the connection idle longest."""

    def __init__(self, server: web.Server, limits: HttpLimits, on_refused: Callable[[], None] | None = None):
        _check_aiohttp()
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.limits = limits
        self.max_connections = limits.max_connections
        self.on_refused = on_refused or (lambda: None)
        # aiohttp's own keep-alive timer stays as a backstop that never fires before ours.
        self._handler_kwargs = {**server._kwargs, "keepalive_timeout": limits.keepalive_timeout + limits.header_timeout}
        self._open: set[_GuardedHandler] = set()
        self._unconnected: dict[_GuardedHandler, float] = {}  # created, connection_made not called yet
        self._idle: dict[_GuardedHandler, None] = {}  # idle connections, the longest idle first
        self.stats: collections.Counter[str] = collections.Counter()

    @property
    def num_open(self) -> int:
        return len(self._open) + len(self._unconnected)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def __call__(self) -> asyncio.Protocol:
        if self._unconnected:
            now = time.monotonic()
            for handler, since in list(self._unconnected.items()):
                if now - since > _UNCONNECTED_S:
                    del self._unconnected[handler]
        if self.num_open >= self.max_connections and not self._evict_one():
            self.stats["refused"] += 1
            return _Refuse(self.on_refused)
        handler = _GuardedHandler(self, **self._handler_kwargs)
        self._unconnected[handler] = time.monotonic()
        return handler

    def _evict_one(self) -> bool:
        if not self._idle:
            return False
        victim = next(iter(self._idle))
        victim._g_close("evicted")
        return True

    def _connected(self, handler: _GuardedHandler) -> None:
        self._unconnected.pop(handler, None)
        self._open.add(handler)

    def _forget(self, handler: _GuardedHandler) -> None:
        self._unconnected.pop(handler, None)
        self._open.discard(handler)
        self._idle.pop(handler, None)


def ensure_fd_headroom(max_connections: int) -> int:
    """Raise this process's soft descriptor limit so ``max_connections`` clients fit beside
    ``_FD_RESERVE`` others; returns the cap that fits (lower, with a warning, when the hard limit
    is too low: past the descriptor limit no connection is accepted, so none could be evicted)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + _FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(hard, want)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return max_connections
    fitting = max(1, soft - min(_FD_RESERVE, soft // 2))
    log.warning("open-file limit %d: serving at most %d HTTP connections instead of %d", soft, fitting,
                max_connections)
    return fitting


class GuardedSite(web.BaseSite):
    """``web.TCPSite`` with ``ConnectionGuard`` in front of the runner's server; stopped by
    ``runner.cleanup()`` like any site.  ``on_refused`` is called for each 503 at the cap."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, limits: HttpLimits,
                 on_refused: Callable[[], None] | None = None):
        super().__init__(runner, backlog=min(4096, limits.max_connections))
        self._host, self._port = host, port
        self.guard = ConnectionGuard(runner.server, limits, on_refused)

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self.port}"

    @property
    def port(self) -> int:
        """The bound port (the one chosen by the system when asked for port 0)."""
        if self._server is None:
            return self._port
        return self._server.sockets[0].getsockname()[1]

    @property
    def stats(self) -> dict[str, int]:
        """Connections open and idle now; closed by the guard, by reason; refused at the cap."""
        return {"open": self.guard.num_open, "idle": self.guard.num_idle, **self.guard.stats}

    async def start(self) -> None:
        await super().start()
        self.guard.max_connections = ensure_fd_headroom(self.guard.limits.max_connections)
        self._server = await asyncio.get_running_loop().create_server(
            self.guard, self._host, self._port, backlog=self._backlog, reuse_address=True)
