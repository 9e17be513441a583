"""Non-blocking socket plumbing shared by the TCP and UCX transports.

``FrameWriter`` puts whole frames on a socket, in order, from the event loop's writability
callbacks. It is what makes a connection shared by many transfers safe to cancel on::

    frames queued:   [A: header|payload ......] [B: header] [C: header|payload]
                      ^ started: A's caller cancelled -> A is still written to its end, then
                        the caller sees CancelledError (A's memory must stay valid until then)
                                                  ^ not started: B's caller cancelled -> B is
                                                    dropped from the queue, never a byte of it

A frame never stops half-way with another frame's bytes behind it: either it goes out whole, or
nothing of it does, or the connection is closed. A frame that makes no progress for
``stall_timeout`` seconds (the peer stopped reading) fails the writer, and ``on_stall`` closes
the connection.

``TcpListener``/``connect_tcp`` open the sockets both transports use (the UCX transport carries
its headers over TCP and only payloads over UCX), bound to the configured interface. A listener
keeps accepting through a full descriptor table, and holds at most a bounded number of
connections that have not authenticated (``PreAuthTable``); until a channel has, it reads no
header longer than ``PREAUTH_MAX_HEADER_BYTES`` (``kvtransfer.handshake``).
"""
from __future__ import annotations

import asyncio
import collections
import errno
import logging
import socket
import weakref
from typing import Awaitable, Callable, Sequence

from kvtransfer.errors import ConnectionLost

log = logging.getLogger(__name__)

_MAX_WRITE_PER_WAKEUP = 16 << 20  # then let the loop run other callbacks before writing more


class _Frame:
    __slots__ = ("parts", "future", "started")

    def __init__(self, parts: list[memoryview], future: asyncio.Future):
        self.parts = parts
        self.future = future
        self.started = False


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # nobody may be waiting any more; never log "never retrieved"


class FrameWriter:
    """Ordered, cancel-safe frame writer for one non-blocking socket (see the module docstring)."""

    def __init__(self, sock: socket.socket, stall_timeout: float, on_stall: Callable[[ConnectionLost], None]):
        self._sock = sock
        self._fd = sock.fileno()
        self._loop = asyncio.get_running_loop()
        self._stall_timeout = stall_timeout
        self._on_stall = on_stall
        self._queue: collections.deque[_Frame] = collections.deque()
        self._error: ConnectionLost | None = None
        self._writing = False  # registered with add_writer
        self._last_progress = 0.0
        self._stall_timer: asyncio.TimerHandle | None = None

    def enqueue(self, parts: Sequence[bytes | memoryview]) -> asyncio.Future:
        """Queue a frame (its parts go out back to back) and start writing; returns its future.

        The frame is committed: it will be written whole unless the connection fails. Use
        ``send`` to be able to withdraw a frame that has not started."""
        return self._enqueue(parts).future

    async def send(self, parts: Sequence[bytes | memoryview]) -> None:
        """Write one frame. Cancelled before its first byte went out, the frame is withdrawn;
        after, the cancellation waits until the frame is out whole (or the connection failed)."""
        frame = self._enqueue(parts)
        try:
            await asyncio.shield(frame.future)
        except asyncio.CancelledError:
            if not frame.started and not frame.future.done():
                self._queue.remove(frame)
                frame.future.cancel()
                raise
            await wait_uncancelled(frame.future)
            raise

    def _enqueue(self, parts: Sequence[bytes | memoryview]) -> _Frame:
        if self._error is not None:
            raise self._error
        future = self._loop.create_future()
        future.add_done_callback(_retrieve)
        frame = _Frame([memoryview(p).cast("B") for p in parts], future)
        self._queue.append(frame)
        if len(self._queue) == 1:
            self._last_progress = self._loop.time()
            self._flush()
        return frame

    def fail(self, error: ConnectionLost) -> None:
        """Stop writing: every queued frame fails with ``error`` (idempotent)."""
        if self._error is not None:
            return
        self._error = error
        self._stop_writing()
        while self._queue:
            frame = self._queue.popleft()
            if not frame.future.done():
                frame.future.set_exception(error)

    # -- internals ---------------------------------------------------------------------------

    def _flush(self) -> None:
        try:
            done = self._pump()
        except ConnectionLost as exc:
            self.fail(exc)
            return
        if done:
            self._stop_writing()
        elif not self._writing:
            self._writing = True
            self._loop.add_writer(self._fd, self._flush)
            self._arm_stall_timer()

    def _pump(self) -> bool:
        """Write as much as the socket takes (bounded per wakeup); True once the queue is empty."""
        budget = _MAX_WRITE_PER_WAKEUP
        while self._queue and budget > 0:
            frame = self._queue[0]
            try:
                n = self._sock.sendmsg(frame.parts)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as exc:
                raise ConnectionLost(f"tcp send failed: {exc}") from None
            frame.started = True
            self._last_progress = self._loop.time()
            budget -= n
            while n:
                head = frame.parts[0]
                if n >= len(head):
                    n -= len(head)
                    frame.parts.pop(0)
                else:
                    frame.parts[0] = head[n:]
                    n = 0
            if not frame.parts:
                self._queue.popleft()
                if not frame.future.done():
                    frame.future.set_result(None)
        return not self._queue

    def _stop_writing(self) -> None:
        if self._writing:
            self._writing = False
            if not self._loop.is_closed():
                self._loop.remove_writer(self._fd)
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _arm_stall_timer(self) -> None:
        if self._stall_timer is None:
            self._stall_timer = self._loop.call_at(self._last_progress + self._stall_timeout, self._check_stall)

    def _check_stall(self) -> None:
        self._stall_timer = None
        if not self._queue or self._error is not None:
            return
        idle = self._loop.time() - self._last_progress
        if idle < self._stall_timeout:
            self._arm_stall_timer()
            return
        error = ConnectionLost(f"peer read nothing for {self._stall_timeout}s")
        self.fail(error)
        self._on_stall(error)


async def wait_uncancelled(fut: asyncio.Future, timeout: float | None = None) -> bool:
    """Wait for ``fut`` to finish (for at most ``timeout``) even if this task is cancelled meanwhile;
    returns whether it was (the cancellations are held back, not lost: the caller re-raises). Only
    for waits bounded by something else, or by ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    cancelled = False
    while not fut.done():
        left = None if deadline is None else deadline - loop.time()
        if left is not None and left <= 0:
            break
        try:
            await asyncio.wait((fut,), timeout=left)
        except asyncio.CancelledError:
            cancelled = True
    return cancelled


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class PreAuthTicket:
    """One accepted connection that has not authenticated yet (see ``PreAuthTable``)."""

    __slots__ = ("_table", "_close")

    def __init__(self, table: "PreAuthTable", close: Callable[[], None]):
        self._table = table
        self._close = close

    def bind(self, close: Callable[[], None]) -> None:
        """``close`` ends the connection from now on (its channel's, once it owns the socket)."""
        self._close = close

    def passed(self) -> None:
        """The connection authenticated, or ended: it no longer counts (idempotent)."""
        self._table._entries.pop(self, None)

    def _evict(self) -> None:
        self.passed()
        self._close()


class PreAuthTable:
    """The connections of one listener that have not authenticated yet: at most ``limit``.

    A newcomer beyond that closes the oldest of them, the one that has had longest to prove
    itself: whoever holds unauthenticated connections open only pushes its own out, while a
    genuine handshake (two round trips) is done long before ``limit`` newer connections arrive."""

    def __init__(self, limit: int):
        self.limit = limit
        self._entries: dict[PreAuthTicket, None] = {}  # oldest first
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def admit(self, sock: socket.socket) -> PreAuthTicket:
        while len(self._entries) >= self.limit:
            self.evicted += 1
            next(iter(self._entries))._evict()
        ticket = PreAuthTicket(self, sock.close)
        self._entries[ticket] = None
        return ticket


# How the accept loop treats an error of accept.  A connection that failed before it was taken
# (Linux reports the pending network errors of a new connection from accept): count it, accept the
# next at once.  The listening socket itself is broken: the loop ends.  Anything else (a full
# descriptor table: EMFILE, ENFILE; no memory: ENOBUFS, ENOMEM): count it, back off and retry; the
# pending connection stays in the backlog meanwhile.
_ACCEPT_CONNECTION_FAILED = {getattr(errno, name) for name in (
    "ECONNABORTED", "ECONNRESET", "EPROTO", "EPERM", "ETIMEDOUT", "ENETDOWN", "ENETUNREACH", "EHOSTDOWN",
    "EHOSTUNREACH", "ENONET", "ENOPROTOOPT", "EOPNOTSUPP") if hasattr(errno, name)}
_ACCEPT_FATAL = {errno.EBADF, errno.ENOTSOCK, errno.EINVAL, errno.EFAULT}
_ACCEPT_BACKOFF = (0.01, 1.0)  # first and longest pause after resource exhaustion
_listeners: "weakref.WeakSet[TcpListener]" = weakref.WeakSet()


class TcpListener:
    """A listening socket bound to ``host:port``; ``on_socket(sock, ticket)`` runs as a task per
    connection, ``ticket`` its place among the ``max_preauth`` unauthenticated connections (the
    transport passes ``KVTransferConfig.max_handshakes``, where the default lives).

    The accept loop outlives a full descriptor table and failed connections (each counted in
    ``accept_errors``); if it ends anyway, ``failure`` says why and ``failed_listeners`` lists it."""

    def __init__(self, host: str, port: int, on_socket: Callable[[socket.socket, PreAuthTicket], Awaitable[None]],
                 max_preauth: int):
        loop = asyncio.get_running_loop()
        sock = socket.socket(_family(host), socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._loop = loop
        self._closed = False
        self._handlers: set[asyncio.Task] = set()  # strong references until each handler ends
        self.preauth = PreAuthTable(max_preauth)
        self.accept_errors: collections.Counter[str] = collections.Counter()  # by errno name
        self.failure: BaseException | None = None
        self.address = f"{host}:{sock.getsockname()[1]}"
        self._task = loop.create_task(self._accept_loop(on_socket))
        _listeners.add(self)

    async def _accept_loop(self, on_socket) -> None:
        backoff = _ACCEPT_BACKOFF[0]
        try:
            while True:
                try:
                    conn, _ = await self._loop.sock_accept(self._sock)
                except OSError as exc:
                    if self._closed or exc.errno in _ACCEPT_FATAL:
                        raise
                    name = errno.errorcode.get(exc.errno, str(exc.errno))
                    self.accept_errors[name] += 1
                    if exc.errno not in _ACCEPT_CONNECTION_FAILED:
                        if backoff == _ACCEPT_BACKOFF[0]:
                            log.warning("kv listener %s: cannot accept (%s); retrying", self.address, exc)
                        await asyncio.sleep(backoff)
                        backoff = min(2 * backoff, _ACCEPT_BACKOFF[1])
                    continue
                backoff = _ACCEPT_BACKOFF[0]
                self._admit(conn, on_socket)
        except asyncio.CancelledError:
            if not self._closed:
                self.failure = RuntimeError("accept loop cancelled")
            raise
        except BaseException as exc:
            if not self._closed:
                self.failure = exc
                self._sock.close()  # peers are refused at once instead of waiting in the backlog
                log.error("kv listener %s stopped accepting: %r", self.address, exc)
            if not isinstance(exc, Exception):
                raise

    def _admit(self, conn: socket.socket, on_socket) -> None:
        try:
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # the peer is gone already
            conn.close()
            return
        ticket = self.preauth.admit(conn)
        task = self._loop.create_task(on_socket(conn, ticket))
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)
        task.add_done_callback(lambda _task: ticket.passed())  # however the handler ended

    @property
    def failed(self) -> bool:
        """The accept loop ended although the listener is open."""
        return not self._closed and (self._task.done() or self.failure is not None)

    def close(self) -> None:
        self._closed = True
        self._task.cancel()
        self._sock.close()


def failed_listeners() -> list[str]:
    """The KV listeners of this process whose accept loop ended while they were open, each with
    why: a worker with one of these accepts no KV and must not report itself healthy."""
    return [f"{lst.address}: {lst.failure!r}" for lst in list(_listeners) if lst.failed]


def listener_stats() -> dict[str, int]:
    """Counters over this process's open KV listeners: accept errors survived (by errno) and
    unauthenticated connections closed for newcomers."""
    out: collections.Counter[str] = collections.Counter()
    for lst in list(_listeners):
        if not lst._closed:
            out["kv_preauth_evicted"] += lst.preauth.evicted
            for name, count in lst.accept_errors.items():
                out[f"kv_accept_errors_{name}"] += count
    return dict(out)


async def connect_tcp(host: str, port: int, timeout: float, what: str = "tcp") -> socket.socket:
    loop = asyncio.get_running_loop()
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.wait_for(loop.sock_connect(sock, (host, port)), timeout)
    except (OSError, asyncio.TimeoutError) as exc:
        sock.close()
        raise ConnectionLost(f"cannot connect to {host}:{port} over {what}: {exc!r}") from None
    except BaseException:
        sock.close()
        raise
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
