"""UCX transport: headers over a TCP connection, payloads as UCX tag messages.

UCX picks shared memory (CMA), RDMA or CUDA IPC for the payloads by itself; the headers, which
are small, travel over a plain TCP connection that the receiver accepts on exactly the
configured interface. One channel, from a sender S to a receiver R::

    S --TCP connect--> R's listener (bound to the configured host:port; no UCX listener at all)
    S <== handshake (layout, cluster secret proofs) over TCP ==> R
    R --TCP: DataPath(R's UCX worker address, random 64-bit tag base)--> S    (authenticated only)
    S: UCX endpoint to R's worker

    frame k on TCP:  u32 header_len | u64 seq | header      seq 0: no payload
                                                            seq n > 0: payload n follows on UCX
    payload n:       UCX tag message, tag = tag_base + n    (S posts it right behind its header)

Why this shape:

* The UCX worker address and tags reach only a peer that passed the handshake, and nothing
  listens on a wildcard address (``ucxx.create_listener`` binds every interface).
* Every payload has a tag of its own, so a payload can never land in the region meant for
  another one, whatever was cancelled or lost before it.
* The TCP connection shows a dead peer at once, even while a payload is awaited: the receiver
  then cancels its pending UCX receive.

Cancellation and failure:

* A sender's frame is committed once queued: header and payload both go out, and a cancelled
  ``send`` waits for the payload to be taken (bounded by ``io_timeout``, after which the channel
  closes, which cancels the UCX send) before the cancellation goes on, because UCX may still be
  reading the source blocks until then.
* ``divert_payload`` cancels the receiver's pending UCX receive. If it had not matched yet, a
  one-byte receive takes the message whenever it comes (the sender completes, nothing lands);
  if it had, it finishes first. Either way ``recv_payload_into`` returns once nothing more can
  land in the region.
* A matched receive cannot be stopped from this side: it ends when its sender completes or
  fails. When the channel ends and such a receive has not ended ``_LATE_CANCEL_S`` later (its
  sender frozen mid-payload), ``recv_payload_into`` raises ``ConnectionLost`` anyway and
  ``still_landing`` hands over the receive's future: the region is not to be reused before it
  ends.
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import re
import secrets
import socket
from typing import Annotated, Awaitable, Callable

import msgspec
import numpy as np
import torch

from kvtransfer.config import KVTransferConfig
from kvtransfer.errors import ConnectionLost, ProtocolError
from kvtransfer.socket_io import PreAuthTicket, TcpListener, connect_tcp, wait_uncancelled
from kvtransfer.transport_base import Channel, Listener, Transport
from kvtransfer.ucx_control import ControlConnection
from kvtransfer.ucx_worker import UcxWorker, net_devices_for

log = logging.getLogger(__name__)

_TAG_MASK = (1 << 64) - 1
_LATE_CANCEL_S = 5.0


class DataPath(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Receiver -> sender, once the handshake has passed: where and how to send payloads."""

    address: Annotated[bytes, msgspec.Meta(min_length=1, max_length=32 * 1024)]
    tag_base: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]


def ucx_settings() -> dict[str, str]:
    """The UCX/ucxx environment in effect, for logs and benchmark output."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(("UCX_", "UCXPY_"))}


def endpoint_lanes(ucp_endpoint: int) -> list[str]:
    """The transports UCX chose for an endpoint, e.g. ``["sysv/memory(am)", "cma/memory(rma_bw)"]``.

    Read from ``ucp_ep_print_info`` (ucxx has no Python API for it); ``[]`` if unavailable.
    """
    try:
        import libucx

        ucp = ctypes.CDLL(os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so.0"))
        libc = ctypes.CDLL(None)
        libc.tmpfile.restype = ctypes.c_void_p
        for fn in (libc.fflush, libc.rewind, libc.fileno, libc.fclose):
            fn.argtypes = [ctypes.c_void_p]
        stream = libc.tmpfile()
        ucp.ucp_ep_print_info(ctypes.c_void_p(ucp_endpoint), ctypes.c_void_p(stream))
        libc.fflush(stream)
        libc.rewind(stream)
        with os.fdopen(os.dup(libc.fileno(stream)), "r") as f:
            text = f.read()
        libc.fclose(stream)
    except Exception as exc:  # diagnostics only; never fail a connection over them
        log.debug("cannot read UCX endpoint info: %r", exc)
        return []
    lanes = []
    for line in text.splitlines():
        m = re.search(r"lane\[\d+\]:\s+\d+:(\S+?)(?:\.\d+)?\s.*?seg \d+\s*(.*)$", line)
        if m:
            lanes.append(f"{m.group(1)}({','.join(m.group(2).split())})")
    return lanes


def _array(region: torch.Tensor):
    # ucxx takes the buffer protocol (host) or __cuda_array_interface__ (device tensors).
    return region.numpy() if region.device.type == "cpu" else region


class UcxChannel(Channel):
    """One sender<->receiver connection: TCP for headers, UCX for payloads (module docstring)."""

    def __init__(self, sock: socket.socket, ucx: UcxWorker, io_timeout: float, ticket: PreAuthTicket | None = None):
        self._ucx = ucx
        self._loop = asyncio.get_running_loop()
        self._io_timeout = io_timeout
        self._control = ControlConnection(sock, io_timeout, self._peer_lost, self._abandon, ticket)
        if ticket is not None:
            ticket.bind(self.close)
        self._error: ConnectionLost | None = None
        self._closed = False
        self._ep = None  # sender: endpoint to the receiver's UCX worker
        self._tag_base: int | None = None
        self._send_seq = 0
        self._last_seq = 0  # receiver: the highest payload number announced so far
        self._announced: int | None = None
        # receiver: the UCX receive in progress as [seq, request]; dropping the request object
        # cancels it (ucxx cancels in its destructor), its future still reports the outcome.
        self._recv: list | None = None
        self._diverted = False
        self._lost = self._loop.create_future()  # resolved once nothing more can come: wakes a receive
        # receiver: a payload UCX was still writing when the channel ended (not stoppable: see _receive)
        self._unstoppable: asyncio.Future | None = None
        self._drains: dict[int, object] = {}  # receiver: payloads being consumed into one byte
        self._sends: dict[int, object] = {}
        self.lanes: list[str] = []

    @property
    def description(self) -> str:
        if self._ep is None:
            return "ucx (receiving side)"
        return "ucx " + (" ".join(self.lanes) or "(lanes unknown)")

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _tag(self, seq: int):
        return self._ucx.tag((self._tag_base + seq) & _TAG_MASK)

    # -- data path ---------------------------------------------------------------------------

    async def open_data_path(self, sender: bool, timeout: float) -> None:
        self._check()
        self._control.authenticated()
        if sender:
            try:
                seq, body = await asyncio.wait_for(self._control.recv_frame(), timeout)
                path = msgspec.msgpack.decode(body, type=DataPath)
            except asyncio.TimeoutError:
                raise ConnectionLost(f"no UCX data path from the receiver within {timeout}s") from None
            except msgspec.DecodeError as exc:
                raise ProtocolError(f"bad DataPath frame: {exc}") from None
            if seq:
                raise ProtocolError("DataPath frame announces a payload")
            self._tag_base = path.tag_base
            try:
                self._ep = self._ucx.connect(path.address)
            except Exception as exc:  # a UCXError naming what UCX could not reach
                raise ConnectionLost(f"cannot reach the receiver's UCX worker: {exc!r}") from None
            self.lanes = endpoint_lanes(self._ep.handle)
        else:
            self._tag_base = secrets.randbits(63)
            body = msgspec.msgpack.encode(DataPath(address=self._ucx.address, tag_base=self._tag_base))
            await self._control.writer.send(self._control.frame(0, body))

    # -- sending -----------------------------------------------------------------------------

    async def send(self, header: bytes, payload: torch.Tensor | None = None) -> None:
        self._check()
        if payload is None:
            await self._control.writer.send(self._control.frame(0, header))
            return
        if self._ep is None:
            raise ConnectionLost("ucx data path is not open")
        self._send_seq += 1
        seq = self._send_seq
        # Committed from here: the header is queued and the payload posted, both go out.
        header_sent = self._control.writer.enqueue(self._control.frame(seq, header))
        request = self._ep.tag_send(self._ucx.array(_array(payload)), self._tag(seq))
        taken = request.future
        self._sends[seq] = request
        try:
            cancelled = await self._settle_send(header_sent, taken)
        finally:
            self._sends.pop(seq, None)
        if cancelled:
            raise asyncio.CancelledError()
        if not taken.done():
            raise self._error or ConnectionLost("ucx send abandoned")
        if header_sent.exception() is not None:
            raise header_sent.exception()
        await self._ucx.wait(taken)

    async def _settle_send(self, header_sent: asyncio.Future, taken: asyncio.Future) -> bool:
        """Wait until header and payload are both out or failed; returns whether this task was
        cancelled meanwhile (the wait goes on regardless: UCX may still read the payload).
        Bounded: after ``io_timeout`` the channel closes, which cancels the UCX send."""
        cancelled = False
        deadline = self._loop.time() + self._io_timeout
        while not (header_sent.done() and taken.done()):
            if header_sent.done() and header_sent.exception() is not None and not self._closed:
                self._abandon(header_sent.exception())  # without its header, nobody takes it
            remaining = deadline - self._loop.time()
            if remaining <= 0:
                if not self._closed:
                    self._abandon(ConnectionLost(f"ucx payload not taken within {self._io_timeout}s"))
                    deadline = self._loop.time() + _LATE_CANCEL_S
                    continue
                log.error("a ucx send did not end %ss after its connection closed", _LATE_CANCEL_S)
                break
            try:
                await asyncio.wait((header_sent, taken), timeout=remaining)
            except asyncio.CancelledError:
                cancelled = True
        return cancelled

    # -- receiving ---------------------------------------------------------------------------

    async def recv_header(self) -> bytes:
        seq, header = await self._control.recv_frame()
        if seq:
            if self._tag_base is None:
                raise ProtocolError("payload announced before the data path was opened")
            if seq <= self._last_seq:
                raise ProtocolError(f"payload number {seq} after {self._last_seq}")
            self._last_seq = seq
        self._announced = seq or None
        return header

    def _take_announced(self) -> int:
        seq, self._announced = self._announced, None
        if seq is None:
            raise ProtocolError("the last header announced no payload")
        return seq

    async def _receive(self, seq: int, buffer) -> asyncio.Future:
        """Post a receive for payload ``seq`` into ``buffer``; wait until it has ended, or until the
        channel has ended and, for at most ``_LATE_CANCEL_S`` more, the receive with it.

        Dropping the request cancels the receive only if UCX has not matched it yet: one already
        landing goes on until its sender completes or fails, which a frozen sender (SIGSTOP, a hung
        host) may never do.  Such a receive is handed to ``still_landing`` and this raises
        ``ConnectionLost``: the region stays the transport's until that future ends."""
        self._check()
        request = self._ucx.worker.tag_recv(self._ucx.array(buffer), self._tag(seq))
        future = request.future
        self._recv = [seq, request]
        del request
        cancelled = False
        try:
            try:
                await asyncio.wait((future, self._lost), return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                cancelled = True
                self.close()  # the reader gave up: nobody can follow this stream any more
            if not future.done():  # the channel ended: the receive was dropped with it
                cancelled |= await wait_uncancelled(future, _LATE_CANCEL_S)
        finally:
            self._recv = None
        if not future.done():
            self._unstoppable = future
            still = self._ucx.still_landing
            still[future] = buffer  # UCX writes into it until then, whoever else lets go of it
            future.add_done_callback(lambda f: (still.pop(f, None), f.cancelled() or f.exception()))
            log.warning("a ucx payload was still landing %ss after its connection ended; its region "
                        "stays reserved until it ends", _LATE_CANCEL_S)
        if cancelled:
            raise asyncio.CancelledError()
        if not future.done():
            raise self._error or ConnectionLost("ucx channel closed")
        return future

    def still_landing(self) -> asyncio.Future | None:
        future = self._unstoppable
        return None if future is None or future.done() else future

    async def recv_payload_into(self, region: torch.Tensor) -> None:
        seq = self._take_announced()
        self._diverted = False
        future = await self._receive(seq, _array(region))
        if future.exception() is None:
            return
        if self._diverted and self._ucx.is_cancelled(future) and self._error is None:
            self._drain(seq)  # the payload is still coming: it must land somewhere harmless
            return
        if self._error is not None:
            raise self._error
        await self._ucx.wait(future)  # raises what went wrong

    def _drain(self, seq: int) -> None:
        """Consume payload ``seq`` into one byte whenever it comes (UCX truncates it without
        moving it), so its sender completes; nobody waits for it."""
        self._check()
        request = self._ucx.worker.tag_recv(self._ucx.array(np.zeros(1, dtype=np.uint8)), self._tag(seq))
        self._drains[seq] = request
        request.future.add_done_callback(lambda _f: self._drains.pop(seq, None))

    async def discard_payload(self, nbytes: int) -> None:
        self._drain(self._take_announced())

    def divert_payload(self) -> bool:
        if self._recv is None:
            return True
        self._diverted = True
        self._recv[1] = None  # cancels the receive if UCX has not matched it yet
        return False

    # -- lifecycle ---------------------------------------------------------------------------

    def _peer_lost(self, error: ConnectionLost) -> None:
        """The TCP half ended (or stalled): nothing more can come, so stop every UCX operation.
        Frames that arrived before the end can still be read."""
        if self._error is None:
            self._error = error
        if not self._lost.done():
            self._lost.set_result(None)
        if self._recv is not None:
            self._recv[1] = None
        self._drains.clear()  # cancels them
        if self._ep is not None:
            ep, self._ep = self._ep, None
            self._ucx.close_endpoint(ep)  # cancels the sends still in flight
        self._sends.clear()

    def _abandon(self, error: ConnectionLost) -> None:
        self._peer_lost(error)
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._peer_lost(ConnectionLost("ucx channel closed"))
        self._control.close(self._error)


class _UcxListener(Listener):
    def __init__(self, listener: TcpListener):
        self._listener = listener
        self.address = listener.address

    def close(self) -> None:
        self._listener.close()


class UcxTransport(Transport):
    """UCX through ucxx's low-level API; ``transport="ucx"``. Listens (TCP) on exactly the
    configured host, and UCX's own TCP sockets stay on that host's interface (``net_devices_for``,
    unless ``UCX_NET_DEVICES`` is set); the sender logs which transports UCX chose
    (``UcxChannel.description``)."""

    name = "ucx"

    def __init__(self, config: KVTransferConfig):
        self._config = config
        self._ucx: UcxWorker | None = None

    def _worker(self) -> UcxWorker:
        if self._ucx is None or self._ucx.loop is not asyncio.get_running_loop():
            if self._ucx is not None:
                self._ucx.release()
            self._ucx = UcxWorker.acquire(net_devices_for(self._config.host))
        return self._ucx

    async def listen(self, host: str, port: int, on_channel: Callable[[Channel], Awaitable[None]]) -> Listener:
        ucx = self._worker()

        async def accepted(sock: socket.socket, ticket: PreAuthTicket) -> None:
            await on_channel(UcxChannel(sock, ucx, self._config.io_timeout, ticket))

        return _UcxListener(TcpListener(host, port, accepted, self._config.max_handshakes))

    async def connect(self, host: str, port: int, timeout: float) -> Channel:
        ucx = self._worker()
        sock = await connect_tcp(host, port, timeout, "ucx")
        return UcxChannel(sock, ucx, self._config.io_timeout)

    def close(self) -> None:
        if self._ucx is not None:
            self._ucx.release()
            self._ucx = None
