"""An HTTP listening socket that a stranger cannot fill with idle connections.

aiohttp accepts every connection it is offered and, by default, lets it sit for an hour without
sending a byte.  ``GuardedSite`` serves an ``AppRunner``'s app under ``HttpLimits``::

    accepted ──► waiting for headers ──(headers complete)──► busy ──(answered)──► keep-alive ──┐
                 closed after header_timeout                 never    closed after             │
                 (408 if it had sent a part)                 evicted  keepalive_timeout        │
                      ▲                                      body: must arrive within          │
                      └───────────────(first byte of the next request)──── body_timeout ◄──────┘

* At ``max_connections`` a newcomer makes room by aborting a connection the guard is closing, else
  by evicting (aborting) the connection idle longest (waiting for headers or between requests);
  only when every connection is busy with a request is the newcomer answered ``503`` +
  ``Retry-After`` and closed, before anything is read from it.
* A request whose body has not arrived in full ``body_timeout`` after its headers: reads of it
  raise ``BodyTimeout`` (aiohttp answers 408; a handler bounding its own read sees a
  ``TimeoutError``), and the connection is closed once the request has been answered.
* Writing, in every state: when a client takes so little that the connection's send buffer
  passes its high-water mark, the transport pauses writing; if it has not resumed within
  ``write_timeout`` the connection is aborted (``write_timeout`` in the stats).  The deadline runs
  only while writing is paused and restarts with each pause, so a long stream to a client that
  reads slowly, but reads, is never cut; a client that never reads its answers (say, thousands of
  pipelined requests) cannot keep a connection busy for ever.
* A request answered before its body was read (a refusal: 401, 413, 415, ...): aiohttp reads the
  rest of the body after such an answer, so that a reset does not cut the answer off on its way,
  for ten seconds at most; the connection then serves the client's next request as any other
  (the answer did not say it would close).  At most ``_LINGER_BYTES`` are read so, and a body
  longer than that closes the connection (``unread_body``), where aiohttp alone would take
  whatever arrives for those ten seconds -- gigabytes from a stranger never authenticated.
* A connection the guard closes (deadlines, 408) keeps its slot until its socket is closed: what
  was written goes out first, and a client that takes none of it within ``write_timeout`` has the
  connection aborted then.  Evictions and write timeouts abort at once.  Every socket of this
  listener is thus counted, from its accept to its close, and none outlives its deadlines.

The states come from aiohttp's ``RequestHandler`` (a subclass here: ``_handle_request`` spans a
request from its complete headers to its answer, ``_messages`` holds parsed requests not yet
handled, ``pause_writing``/``resume_writing`` are the transport's flow control); ``_check_aiohttp``
refuses to start on an aiohttp without them, or with a name of its own in the ``_g_`` namespace the
subclass keeps its state in.
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import re
import resource
import time
from typing import Callable

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, ContentEncodingError, HttpProcessingError, LineTooLong

from common.cluster.http_limits import HttpLimits

log = logging.getLogger(__name__)

_REFUSAL_BODY = json.dumps({"error": {
    "message": "The server has too many open connections; retry shortly", "type": "service_unavailable_error",
    "param": None, "code": "too_many_connections"}}).encode()
_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: " + str(len(_REFUSAL_BODY)).encode() + b"\r\n\r\n" + _REFUSAL_BODY)
_HEADER_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
BODY_ENCODINGS = ("identity", "gzip", "deflate")  # what aiohttp inflates here (brotli and zstd: not installed)
_UNCONNECTED_S = 1.0  # a protocol without a transport after this long never gets one
_FD_RESERVE = 1024  # descriptors kept for everything but this listener's clients
# Of a body left unread by its answer, read before the connection is cut: a client that sends its
# whole body before it reads the answer (urllib, requests) sees a 413 for a body up to 16 times the
# gateway's limit, where a reset would cut the answer off.
_LINGER_BYTES = 64 << 20


class BodyTimeout(web.HTTPRequestTimeout, TimeoutError):
    """A request body that did not arrive within ``body_timeout``: a 408 to aiohttp, and a
    ``TimeoutError`` to a handler that bounds its own read (and answers in its own format)."""


def _check_aiohttp() -> None:
    handler_attrs = ("_handle_request", "_messages", "force_close", "writing_paused")
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
        transport.write(_REFUSAL)  # a few hundred bytes into an empty socket buffer: close() frees it at once
        transport.close()


def _malformed(exc: HttpProcessingError) -> tuple[int, str, str]:
    """A malformed request's status, message and code: a line too long (the request's target 414,
    a header field 431), too many header fields (431), a body encoding it cannot read (415), else
    400 with the parser's first line."""
    if isinstance(exc, LineTooLong):
        line, limit = exc.args[0], exc.args[1]
        if isinstance(line, (bytes, bytearray)) and line.startswith(b"/"):
            return 414, f"the request's target is longer than {limit} bytes", "uri_too_long"
        return 431, f"a header field is longer than {limit} bytes", "request_header_fields_too_large"
    if isinstance(exc, ContentEncodingError):  # one aiohttp cannot inflate here (brotli, zstd)
        named = re.search(r"content-encoding: ([^.]{1,40})", str(exc.message))
        return 415, (f"Content-Encoding {named.group(1) if named else 'of the body'} is not supported: send the body "
                     f"as {', '.join(BODY_ENCODINGS)}"), "unsupported_content_encoding"
    first = str(exc.message).split("\n", 1)[0].strip()[:200]
    if isinstance(exc, BadHttpMessage) and first == "Too many headers received":
        return 431, "the request has too many header fields", "request_header_fields_too_large"
    return 400, f"malformed HTTP request: {first or type(exc).__name__}", "malformed_request"


class _GuardedHandler(web.RequestHandler):
    """aiohttp's protocol for one connection, with the deadlines of its state (module docstring)."""

    def __init__(self, guard: "ConnectionGuard", **kwargs):
        super().__init__(guard.server, loop=guard.loop, **kwargs)
        self._g_guard = guard
        self._g_transport: asyncio.Transport | None = None  # kept: aiohttp drops its own when it closes
        self._g_deadline: asyncio.TimerHandle | None = None  # the state's: headers, keep-alive or closing
        self._g_write_deadline: asyncio.TimerHandle | None = None  # runs while writing is paused
        self._g_busy = False  # a request's headers are complete and it is not answered yet
        self._g_waiting_headers = True  # idle kind: False while between requests (keep-alive)
        self._g_partial = False  # bytes of the next request's headers arrived
        self._g_body_overdue = False
        self._g_lingering: web.BaseRequest | None = None  # answered before its body was read, the rest to come
        self._g_lingered = 0  # bytes of that rest taken
        self._g_gone = False  # being closed by the guard, or closed

    # -- asyncio protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._g_transport = transport  # type: ignore[assignment]
        self._g_guard._connected(self)
        self._g_become_idle(waiting_headers=True)

    def data_received(self, data: bytes) -> None:
        if self._g_lingering is not None:  # the rest of a body its answer left unread
            self._g_lingered += len(data)
            if self._g_lingered > _LINGER_BYTES:
                self._g_close("unread_body")
                return
            super().data_received(data)
            if self._g_lingering.content.is_eof():
                self._g_lingering = None  # all of it: keep-alive, as after any answer
            return
        if not self._g_busy and data and not self._g_partial:
            self._g_partial = True
            if not self._g_waiting_headers:  # a new request begins: its headers have header_timeout
                self._g_become_idle(waiting_headers=True, partial=True)
        super().data_received(data)
        if not self._g_busy and self._messages:  # a whole request (headers) arrived
            self._g_become_busy()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._g_write_deadline is None and self._g_transport is not None:
            self._g_write_deadline = self._loop.call_later(self._g_guard.limits.write_timeout,
                                                           self._g_write_deadline_passed)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._g_cancel_write_deadline()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._g_gone = True
        self._g_cancel_deadline()
        self._g_cancel_write_deadline()
        self._g_transport = None
        self._g_guard._forget(self)
        super().connection_lost(exc)

    # -- requests ----------------------------------------------------------------------------

    def log_exception(self, *args, **kwargs) -> None:
        """A stranger's malformed request (aiohttp's ``HttpProcessingError``: a bad request line,
        headers too many or too long, bad framing) is answered 400 by aiohttp, counted
        (``malformed``) and logged in one line at debug level, not as an error with a traceback:
        it says nothing of this server, and a stranger could fill the log with them."""
        exc = kwargs.get("exc_info")
        if isinstance(exc, HttpProcessingError):
            self._g_guard._count("malformed")
            self.logger.debug("malformed HTTP request refused: %.200r", exc.message)
            return
        super().log_exception(*args, **kwargs)

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """A malformed request is answered in the API's error shape (JSON), with the status HTTP has
        for its fault, and without echoing what it sent (aiohttp answers such a request in plain
        text, quoting its bytes); anything else as aiohttp does."""
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        self.log_exception("Error handling request", exc_info=exc)  # counted, one line at debug level
        if request.writer.output_size > 0:
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        status, text, code = _malformed(exc)
        body = json.dumps({"error": {"message": text, "type": "invalid_request_error", "param": None, "code": code}})
        response = web.Response(status=status, text=body, content_type="application/json")
        response.force_close()
        return response

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
                if not request.content.is_eof():  # answered before its body was read: aiohttp reads the rest
                    self._g_lingering, self._g_lingered = request, 0
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
            if self._g_partial and self._g_transport is not None:
                self._g_transport.write(_HEADER_TIMEOUT)
            self._g_close("header_timeout")
        else:
            self._g_close("keepalive_timeout")

    def _g_write_deadline_passed(self) -> None:
        self._g_write_deadline = None
        if not self.writing_paused or self._g_transport is None:
            return
        # A connection already being closed was counted under its reason (by the guard, or by a
        # handler that cut it off itself with transport.abort(): the same deadline, raced).
        if not self._g_gone and not self._g_transport.is_closing():
            self._g_guard._count("write_timeout")
            self._g_guard.on_write_timeout()
        self._g_abort()

    def _g_cancel_deadline(self) -> None:
        if self._g_deadline is not None:
            self._g_deadline.cancel()
            self._g_deadline = None

    def _g_cancel_write_deadline(self) -> None:
        if self._g_write_deadline is not None:
            self._g_write_deadline.cancel()
            self._g_write_deadline = None

    def _g_close(self, why: str) -> None:
        """Close this connection after what is written goes out; it keeps its slot until its socket
        is closed, and is aborted if the client has not taken that within ``write_timeout``."""
        if self._g_gone:
            return
        self._g_guard._count(why)
        self._g_gone = True
        self._g_cancel_deadline()
        self._g_guard._closing_started(self)
        self._g_deadline = self._loop.call_later(self._g_guard.limits.write_timeout, self._g_abort)
        self.force_close()  # transport.close(): flushes, then closes the socket

    def _g_evict(self) -> None:
        self._g_guard._count("evicted")
        self._g_abort()

    def _g_abort(self) -> None:
        """Close the socket now, dropping what is unsent: its slot is free at once."""
        self._g_gone = True
        self._g_cancel_deadline()
        self._g_cancel_write_deadline()
        self._g_guard._forget(self)
        if self._g_transport is not None:
            self._g_transport.abort()  # connection_lost follows on the next loop iteration
        self.force_close()  # ends aiohttp's request loop


class ConnectionGuard:
    """The listening socket's protocol factory: counts every connection from its accept (aiohttp
    registers one only a loop iteration later, so a burst of accepts cannot overshoot the cap) to
    its socket's close, and makes room at the cap by aborting a connection being closed, else the
    connection idle longest.  ``on_write_timeout`` is called for each connection aborted at the
    write deadline."""

    def __init__(self, server: web.Server, limits: HttpLimits, on_refused: Callable[[], None] | None = None,
                 on_write_timeout: Callable[[], None] | None = None):
        _check_aiohttp()
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.limits = limits
        self.max_connections = limits.max_connections
        self.on_refused = on_refused or (lambda: None)
        self.on_write_timeout = on_write_timeout or (lambda: None)
        # aiohttp's own keep-alive timer stays as a backstop that never fires before ours.
        self._handler_kwargs = {**server._kwargs, "keepalive_timeout": limits.keepalive_timeout + limits.header_timeout}
        self._open: set[_GuardedHandler] = set()  # connected, socket not closed yet (closing ones too)
        self._unconnected: dict[_GuardedHandler, float] = {}  # created, connection_made not called yet
        self._idle: dict[_GuardedHandler, None] = {}  # idle connections, the longest idle first
        self._closing: dict[_GuardedHandler, None] = {}  # closed by the guard, socket not closed yet; oldest first
        self.stats: collections.Counter[str] = collections.Counter()

    @property
    def num_open(self) -> int:
        return len(self._open) + len(self._unconnected)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    @property
    def num_closing(self) -> int:
        return len(self._closing)

    def __call__(self) -> asyncio.Protocol:
        if self._unconnected:
            now = time.monotonic()
            for handler, since in list(self._unconnected.items()):
                if now - since > _UNCONNECTED_S:
                    del self._unconnected[handler]
        if self.num_open >= self.max_connections and not self._make_room():
            self._count("refused")
            return _Refuse(self.on_refused)
        handler = _GuardedHandler(self, **self._handler_kwargs)
        self._unconnected[handler] = time.monotonic()
        return handler

    def _make_room(self) -> bool:
        if self._closing:
            next(iter(self._closing))._g_abort()
            return True
        if self._idle:
            next(iter(self._idle))._g_evict()
            return True
        return False

    def _count(self, why: str) -> None:
        self.stats[why] += 1

    def _connected(self, handler: _GuardedHandler) -> None:
        self._unconnected.pop(handler, None)
        self._open.add(handler)

    def _closing_started(self, handler: _GuardedHandler) -> None:
        self._idle.pop(handler, None)
        if handler in self._open:
            self._closing[handler] = None

    def _forget(self, handler: _GuardedHandler) -> None:
        self._unconnected.pop(handler, None)
        self._open.discard(handler)
        self._idle.pop(handler, None)
        self._closing.pop(handler, None)


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
    ``runner.cleanup()`` like any site.  ``on_refused`` is called for each 503 at the cap,
    ``on_write_timeout`` for each connection cut off at the write deadline."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, limits: HttpLimits,
                 on_refused: Callable[[], None] | None = None, on_write_timeout: Callable[[], None] | None = None):
        super().__init__(runner, backlog=min(4096, limits.max_connections))
        self._host, self._port = host, port
        self.guard = ConnectionGuard(runner.server, limits, on_refused, on_write_timeout)

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
        """Connections open, idle and being closed now; closed by the guard, by reason; refused at the cap."""
        return {"open": self.guard.num_open, "idle": self.guard.num_idle, "closing": self.guard.num_closing,
                **self.guard.stats}

    async def start(self) -> None:
        await super().start()
        self.guard.max_connections = ensure_fd_headroom(self.guard.limits.max_connections)
        self._server = await asyncio.get_running_loop().create_server(
            self.guard, self._host, self._port, backlog=self._backlog, reuse_address=True)
