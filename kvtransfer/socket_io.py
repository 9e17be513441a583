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

``listen_tcp``/``connect_tcp`` open the sockets both transports use (the UCX transport carries
its headers over TCP and only payloads over UCX), bound to the configured interface.
"""
from __future__ import annotations

import asyncio
import collections
import socket
from typing import Awaitable, Callable, Sequence

from kvtransfer.errors import ConnectionLost

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


async def wait_uncancelled(fut: asyncio.Future) -> None:
    """Wait for ``fut`` to finish even if this task is cancelled meanwhile (the cancellations are
    held back, not lost: the caller re-raises). Only for waits bounded by something else."""
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            continue
        except Exception:
            return


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class TcpListener:
    """A listening socket bound to ``host:port``; ``on_socket`` runs as a task per connection."""

    def __init__(self, host: str, port: int, on_socket: Callable[[socket.socket], Awaitable[None]]):
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
        self._handlers: set[asyncio.Task] = set()  # strong references until each handler ends
        self.address = f"{host}:{sock.getsockname()[1]}"
        self._task = loop.create_task(self._accept_loop(loop, on_socket))

    async def _accept_loop(self, loop, on_socket) -> None:
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = loop.create_task(on_socket(conn))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    def close(self) -> None:
        self._task.cancel()
        self._sock.close()


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
