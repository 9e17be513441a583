"""TCP transport on plain asyncio sockets, for hosts without UCX.

Frame on the wire: ``u32 header_len | header | payload`` (the payload length is in the header,
which the protocol validates before the payload is read). Host payloads go from and into the
cache memory directly (``send``/``recv_into`` on memoryviews of the cache): no intermediate copy.

A device (CUDA) cache goes through a pinned host buffer per direction, reused for every frame
and at most ``STAGING_BYTES`` (senders split bigger runs, see ``max_payload_nbytes``, and stage
a single block larger than that whole; a bigger incoming payload is received piece by piece).
The device<->host copies run in a worker thread, never on the event loop, and are waited for
even when the caller is cancelled (the buffer is not handed to the next frame while a copy
still writes it)::

    send:  device blocks --copy (thread)--> pinned buffer --socket (FrameWriter)--> peer
    recv:  peer --socket--> pinned buffer --copy (thread)--> device blocks   (repeat per piece)
"""
from __future__ import annotations

import asyncio
import socket
import struct
from typing import Awaitable, Callable

import torch

from kvtransfer.config import KVTransferConfig
from kvtransfer.errors import ConnectionLost, ProtocolError
from kvtransfer.handshake import PREAUTH_MAX_HEADER_BYTES
from kvtransfer.messages import MAX_HEADER_BYTES
from kvtransfer.socket_io import FrameWriter, PreAuthTicket, TcpListener, connect_tcp, wait_uncancelled
from kvtransfer.transport_base import Channel, Listener, Transport

_LEN = struct.Struct("!I")
_DISCARD_CHUNK = 1 << 20
_MAX_READ_PER_WAKEUP = 16 << 20
STAGING_BYTES = 64 << 20


def _host_view(region: torch.Tensor) -> memoryview:
    return memoryview(region.numpy()).cast("B")


def needs_staging(tensor: torch.Tensor) -> bool:
    """Whether a payload region must go through the host staging buffer (device memory)."""
    return tensor.device.type != "cpu"


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)  # synchronous: done (on the device too) when it returns


async def _copy_off_loop(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` in a worker thread; waits for it to end even if cancelled meanwhile."""
    copy = asyncio.ensure_future(asyncio.to_thread(_copy, dst, src))
    try:
        await asyncio.shield(copy)
    except asyncio.CancelledError:
        await wait_uncancelled(copy)
        raise


class _Staging:
    """A pinned host buffer for device payloads, one frame at a time (``lock``); grown on demand
    (``bounded``: up to ``STAGING_BYTES``, what a peer may make us hold) and then reused."""

    def __init__(self, bounded: bool = True) -> None:
        self.lock = asyncio.Lock()
        self.bounded = bounded
        self._buffer: torch.Tensor | None = None

    def view(self, nbytes: int) -> torch.Tensor:
        assert 0 < nbytes and (nbytes <= STAGING_BYTES or not self.bounded), \
            f"staging {nbytes} bytes (limit {STAGING_BYTES})"
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return self._buffer[:nbytes]


class TcpChannel(Channel):
    """One TCP connection carrying frames in both directions.

    Receives run on the event loop's readiness callbacks (``add_reader``), not on
    ``sock_recv_into``: every byte is copied in ``_pump``, on the loop thread, into whatever the
    pending receive points at right then. That makes two guarantees cheap and loop-independent:
    ``divert_payload`` takes effect before the next byte, and ``close`` ends a pending receive at
    once (the stdlib loop does not wake a ``sock_recv_into`` whose socket was closed).

    Until ``open_data_path`` (the handshake passed) a header may announce at most
    ``PREAUTH_MAX_HEADER_BYTES``; a longer one is refused before a byte of it is read. An accepted
    connection's ``ticket`` is its place among its listener's unauthenticated connections.
    """

    @property
    def max_payload_nbytes(self) -> int:
        return STAGING_BYTES

    def __init__(self, sock: socket.socket, io_timeout: float = 30.0, ticket: PreAuthTicket | None = None):
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._fd = sock.fileno()
        self._loop = asyncio.get_running_loop()
        self._writer = FrameWriter(sock, io_timeout, self._on_stall)
        self._io_timeout = io_timeout
        self._rx_progress_at = 0.0  # when the receive in progress last got a byte
        self._rx_stall: asyncio.TimerHandle | None = None
        self._closed = False
        self._error: ConnectionLost | None = None
        self._len_buf = bytearray(_LEN.size)
        self._scratch: bytearray | None = None
        # The receive in progress: what is still to fill, whether it is a divertable payload,
        # whether it was diverted (bytes go to the scratch buffer), and who waits for it.
        self._rx_view: memoryview | None = None
        self._rx_payload = False
        self._rx_diverted = False
        self._rx_waiter: asyncio.Future | None = None
        # Device payloads only.  What this worker sends is its own blocks, split into frames of at
        # most STAGING_BYTES -- but for one block larger than that (a large model's layers at a
        # large block size), which goes whole.
        self._out_staging = _Staging(bounded=False)
        self._in_staging = _Staging()
        self._diverting = False  # the device payload being received was diverted
        self._copying = False  # a staged piece is being copied into the device region
        self._header_limit = PREAUTH_MAX_HEADER_BYTES  # MAX_HEADER_BYTES once authenticated
        self._ticket = ticket
        if ticket is not None:
            ticket.bind(self.close)

    @property
    def description(self) -> str:
        try:
            return f"tcp {self._sock.getsockname()[:2]} -> {self._sock.getpeername()[:2]}"
        except OSError:
            return "tcp (closed)"

    async def send(self, header: bytes, payload: torch.Tensor | None = None) -> None:
        """Cancel-safe (``FrameWriter``): a cancelled send leaves no half frame on the wire."""
        if self._error is not None:
            raise self._error
        parts = [_LEN.pack(len(header)) + header]
        if payload is None or not needs_staging(payload):
            if payload is not None:
                parts.append(_host_view(payload))
            await self._writer.send(parts)
            return
        async with self._out_staging.lock:  # the buffer is reused once this frame is out or withdrawn
            host = self._out_staging.view(payload.numel())
            await _copy_off_loop(host, payload)
            await self._writer.send([*parts, _host_view(host)])

    async def open_data_path(self, sender: bool, timeout: float) -> None:
        self._header_limit = MAX_HEADER_BYTES
        if self._ticket is not None:
            self._ticket.passed()

    def _on_stall(self, error: ConnectionLost) -> None:
        self._fail(error)
        self.close()

    # -- receiving ---------------------------------------------------------------------------

    async def _recv_exact(self, view: memoryview, payload: bool = False, idle: bool = False) -> None:
        """Fill ``view`` from the stream.  Inside a frame, a peer that sends nothing for
        ``io_timeout`` is lost and the channel closes (its staging buffer and this task with it);
        ``idle``: the start of the next frame, which may take as long as the peer likes to come --
        and no longer than that to complete once its first byte has."""
        if self._error is not None:
            raise self._error
        assert self._rx_view is None, "TcpChannel receives must not overlap"
        self._rx_view, self._rx_payload, self._rx_diverted = view, payload, False
        try:
            if self._pump():
                return
            self._rx_waiter = self._loop.create_future()
            self._loop.add_reader(self._fd, self._on_readable)
            if not idle or len(self._rx_view) < len(view):  # (the next frame has begun: bounded now)
                self._arm_rx_stall()
            try:
                await self._rx_waiter
            except asyncio.CancelledError:
                # The stream is now somewhere inside a frame: nobody can read this connection
                # correctly any more, so it ends here.
                self.close()
                raise
        except ConnectionLost as exc:
            self._fail(exc)
            raise
        finally:
            self._rx_view, self._rx_payload, self._rx_waiter = None, False, None
            if self._rx_stall is not None:
                self._rx_stall.cancel()
                self._rx_stall = None

    def _arm_rx_stall(self) -> None:
        self._rx_progress_at = self._loop.time()
        self._rx_stall = self._loop.call_later(self._io_timeout, self._check_rx_stall)

    def _check_rx_stall(self) -> None:
        quiet = self._loop.time() - self._rx_progress_at
        if quiet < self._io_timeout:
            self._rx_stall = self._loop.call_later(self._io_timeout - quiet, self._check_rx_stall)
            return
        self._rx_stall = None
        self._on_stall(ConnectionLost(f"peer sent nothing for {self._io_timeout}s in the middle of a frame"))

    def _pump(self) -> bool:
        """Copy what the socket holds into the pending receive; True once it is complete.

        Reads at most ``_MAX_READ_PER_WAKEUP`` bytes per call so one big payload does not keep
        the event loop from everything else; the reader stays registered for the rest.
        """
        view = self._rx_view
        budget = _MAX_READ_PER_WAKEUP
        while view and budget > 0:
            if self._rx_diverted:
                if self._scratch is None:
                    self._scratch = bytearray(_DISCARD_CHUNK)
                target = memoryview(self._scratch)[: min(len(view), len(self._scratch))]
            else:
                target = view
            try:
                n = self._sock.recv_into(target)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                raise ConnectionLost(f"tcp receive failed: {exc}") from None
            if n == 0:
                raise ConnectionLost("peer closed the tcp connection")
            self._rx_progress_at = self._loop.time()
            if self._rx_stall is None and self._rx_waiter is not None:  # an idle wait's first byte
                self._arm_rx_stall()
            view = view[n:]
            budget -= n
        self._rx_view = view
        return not view

    def _on_readable(self) -> None:
        waiter = self._rx_waiter
        if waiter is None or waiter.done():
            self._loop.remove_reader(self._fd)
            return
        try:
            complete = self._pump()
        except ConnectionLost as exc:
            self._loop.remove_reader(self._fd)
            waiter.set_exception(exc)
            return
        if complete:
            self._loop.remove_reader(self._fd)
            waiter.set_result(None)

    def divert_payload(self) -> bool:
        if self._rx_payload:
            self._rx_diverted = True  # _pump reads the rest into the scratch buffer
            self._diverting = True  # a staged device payload: no further piece is copied in
            return True
        if self._copying:
            self._diverting = True
            return False  # a staged piece is being copied into the region: wait for it to end
        return True

    async def recv_header(self) -> bytes:
        await self._recv_exact(memoryview(self._len_buf), idle=True)
        (length,) = _LEN.unpack(self._len_buf)
        if not 0 < length <= self._header_limit:
            raise ProtocolError(f"frame announces a {length}-byte header (limit {self._header_limit})")
        header = bytearray(length)
        await self._recv_exact(memoryview(header))
        return bytes(header)

    async def recv_payload_into(self, region: torch.Tensor) -> None:
        if not needs_staging(region):
            await self._recv_exact(_host_view(region), payload=True)
            return
        total = region.numel()
        self._diverting = False
        async with self._in_staging.lock:
            for start in range(0, total, STAGING_BYTES):
                piece = region[start : start + STAGING_BYTES]
                host = self._in_staging.view(piece.numel())
                await self._recv_exact(_host_view(host), payload=True)
                if not self._diverting:
                    self._copying = True
                    try:
                        await _copy_off_loop(piece, host)
                    except asyncio.CancelledError:
                        self.close()  # the stream is inside this payload: nobody can follow it now
                        raise
                    finally:
                        self._copying = False
                if self._diverting:  # nothing more lands in the region: drop the rest
                    await self.discard_payload(total - start - piece.numel())
                    return

    async def discard_payload(self, nbytes: int) -> None:
        if self._scratch is None:
            self._scratch = bytearray(min(_DISCARD_CHUNK, max(nbytes, 1)))
        while nbytes > 0:
            chunk = min(nbytes, len(self._scratch))
            await self._recv_exact(memoryview(self._scratch)[:chunk])
            nbytes -= chunk

    # -- lifecycle ---------------------------------------------------------------------------

    def _fail(self, error: ConnectionLost) -> None:
        if self._error is None:
            self._error = error

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._ticket is not None:
            self._ticket.passed()
        self._fail(ConnectionLost("tcp channel closed"))
        self._writer.fail(self._error)
        if not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        waiter = self._rx_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(self._error)
        self._sock.close()


class _TcpListener(Listener):
    def __init__(self, listener: TcpListener):
        self._listener = listener
        self.address = listener.address

    def close(self) -> None:
        self._listener.close()


class TcpTransport(Transport):
    """Plain TCP; selected with ``transport="tcp"``. Listens on exactly the configured host."""

    name = "tcp"

    def __init__(self, config: KVTransferConfig):
        self._io_timeout = config.io_timeout
        self._max_handshakes = config.max_handshakes

    async def listen(self, host: str, port: int, on_channel: Callable[[Channel], Awaitable[None]]) -> Listener:
        async def accepted(sock: socket.socket, ticket: PreAuthTicket) -> None:
            await on_channel(TcpChannel(sock, self._io_timeout, ticket))

        return _TcpListener(TcpListener(host, port, accepted, self._max_handshakes))

    async def connect(self, host: str, port: int, timeout: float) -> Channel:
        return TcpChannel(await connect_tcp(host, port, timeout), self._io_timeout)
