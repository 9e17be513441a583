"""The TCP half of a UCX channel (``kvtransfer.transport_ucx``): the frames that announce payloads."""
from __future__ import annotations

import asyncio
import socket
import struct
from typing import Callable

from kvtransfer.errors import ConnectionLost, ProtocolError
from kvtransfer.handshake import PREAUTH_MAX_HEADER_BYTES
from kvtransfer.messages import MAX_HEADER_BYTES
from kvtransfer.socket_io import FrameWriter, PreAuthTicket

CONTROL = struct.Struct("!IQ")  # header length, payload sequence number (0: none)
_MAX_BUFFERED = 4 * (MAX_HEADER_BYTES + CONTROL.size)  # then stop reading until frames are taken
_PREAUTH_BUFFERED = PREAUTH_MAX_HEADER_BYTES + CONTROL.size  # the same, before authentication: one frame
_RECV_BYTES = 256 * 1024


class ControlConnection:
    """The TCP half of a UCX channel: buffered frame reader plus the cancel-safe writer.

    The reader is always registered (up to ``_MAX_BUFFERED``), so the end of the connection is
    seen the moment it happens, even while the channel's owner is waiting for a payload. Until
    ``authenticated()``, it buffers at most one frame of ``PREAUTH_MAX_HEADER_BYTES``."""

    def __init__(self, sock: socket.socket, io_timeout: float, on_lost: Callable[[ConnectionLost], None],
                 on_stall: Callable[[ConnectionLost], None], ticket: PreAuthTicket | None = None):
        self._sock = sock
        self._fd = sock.fileno()
        self._loop = asyncio.get_running_loop()
        self.writer = FrameWriter(sock, io_timeout, on_stall)
        self._on_lost = on_lost
        self._buf = bytearray()
        self._eof: ConnectionLost | None = None  # what ended the stream; buffered frames still count
        self._closed = False
        self._waiter: asyncio.Future | None = None
        self._reading = True
        self._header_limit = PREAUTH_MAX_HEADER_BYTES
        self._max_buffered = _PREAUTH_BUFFERED
        self._ticket = ticket
        self._loop.add_reader(self._fd, self._on_readable)

    def authenticated(self) -> None:
        """The handshake passed: full-size frames from now on."""
        self._header_limit, self._max_buffered = MAX_HEADER_BYTES, _MAX_BUFFERED
        if self._ticket is not None:
            self._ticket.passed()
        self._resume()

    @staticmethod
    def frame(seq: int, header: bytes) -> list[bytes]:
        return [CONTROL.pack(len(header), seq), header]

    def _on_readable(self) -> None:
        try:
            data = self._sock.recv(max(1, min(_RECV_BYTES, self._max_buffered - len(self._buf))))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._ended(ConnectionLost(f"ucx channel: tcp receive failed: {exc}"))
            return
        if not data:
            self._ended(ConnectionLost("peer closed the connection"))
            return
        self._buf += data
        if len(self._buf) >= self._max_buffered:
            self._pause()
        self._wake()

    def _ended(self, error: ConnectionLost) -> None:
        if self._eof is None:
            self._eof = error
        self._pause()
        self._wake()
        self._on_lost(error)

    def _pause(self) -> None:
        if self._reading:
            self._reading = False
            if not self._loop.is_closed():
                self._loop.remove_reader(self._fd)

    def _resume(self) -> None:
        if not self._reading and self._eof is None and not self._closed and len(self._buf) < self._max_buffered:
            self._reading = True
            self._loop.add_reader(self._fd, self._on_readable)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _take_frame(self) -> tuple[int, bytes] | None:
        if len(self._buf) < CONTROL.size:
            return None
        length, seq = CONTROL.unpack_from(self._buf)
        if not 0 < length <= self._header_limit:
            raise ProtocolError(f"frame announces a {length}-byte header (limit {self._header_limit})")
        end = CONTROL.size + length
        if len(self._buf) < end:
            return None
        header = bytes(self._buf[CONTROL.size : end])
        del self._buf[:end]
        self._resume()
        return seq, header

    async def recv_frame(self) -> tuple[int, bytes]:
        """The next ``(seq, header)``; frames buffered before the end still come out first."""
        while True:
            if self._closed:
                raise ConnectionLost("ucx channel closed")
            frame = self._take_frame()
            if frame is not None:
                return frame
            if self._eof is not None:
                raise self._eof
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def close(self, error: ConnectionLost) -> None:
        if self._closed:
            return
        self._closed = True
        if self._ticket is not None:
            self._ticket.passed()
        self._pause()
        self.writer.fail(error)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(error)
        self._sock.close()
