"""In-process transport: two queues per connection, for unit tests of everything above it.

It keeps the semantics that matter to the protocol: frames arrive in order, a payload is copied
straight from the sender's region into the receiver's region (``send`` returns once it has been
consumed, like a zero-copy send), and closing either end fails both.
"""
from __future__ import annotations

import asyncio
import itertools
from typing import Awaitable, Callable

import torch

from kvtransfer.errors import ConnectionLost, ProtocolError
from kvtransfer.messages import MAX_HEADER_BYTES
from kvtransfer.transport_base import Channel, Listener, Transport

_CLOSED = object()


class InProcChannel(Channel):
    """One end of an in-process connection."""

    def __init__(self) -> None:
        self._inbox: asyncio.Queue = asyncio.Queue()
        self.peer: InProcChannel | None = None
        self._closed = False
        self._send_lock = asyncio.Lock()
        self._pending: tuple[torch.Tensor | None, asyncio.Future | None] = (None, None)

    @property
    def description(self) -> str:
        return "inproc"

    async def send(self, header: bytes, payload: torch.Tensor | None = None) -> None:
        async with self._send_lock:
            if self._closed or self.peer is None or self.peer._closed:
                raise ConnectionLost("inproc channel closed")
            consumed = asyncio.get_running_loop().create_future() if payload is not None else None
            self.peer._inbox.put_nowait((bytes(header), payload, consumed))
            if consumed is not None:
                await consumed

    async def recv_header(self) -> bytes:
        if self._closed:
            raise ConnectionLost("inproc channel closed")
        item = await self._inbox.get()
        if item is _CLOSED:
            self._closed = True
            raise ConnectionLost("inproc peer closed the channel")
        header, payload, consumed = item
        if len(header) > MAX_HEADER_BYTES:
            raise ProtocolError(f"frame announces a {len(header)}-byte header (limit {MAX_HEADER_BYTES})")
        self._pending = (payload, consumed)
        return header

    def _take_payload(self) -> tuple[torch.Tensor, asyncio.Future]:
        payload, consumed = self._pending
        self._pending = (None, None)
        if payload is None:
            raise ProtocolError("header announced a payload but none followed")
        return payload, consumed

    async def recv_payload_into(self, region: torch.Tensor) -> None:
        payload, consumed = self._take_payload()
        try:
            if payload.numel() != region.numel():
                raise ProtocolError(f"payload of {payload.numel()} bytes for a {region.numel()}-byte region")
            region.copy_(payload)
        finally:
            if not consumed.done():
                consumed.set_result(None)

    def divert_payload(self) -> bool:
        return True  # recv_payload_into copies in one synchronous step: nothing is ever half-landed

    async def discard_payload(self, nbytes: int) -> None:
        _, consumed = self._take_payload()
        if not consumed.done():
            consumed.set_result(None)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fail_pending()
        if self.peer is not None and not self.peer._closed:
            self.peer._inbox.put_nowait(_CLOSED)

    def _fail_pending(self) -> None:
        _, consumed = self._pending
        if consumed is not None and not consumed.done():
            consumed.set_exception(ConnectionLost("inproc channel closed"))
        while not self._inbox.empty():
            item = self._inbox.get_nowait()
            if item is not _CLOSED and item[2] is not None and not item[2].done():
                item[2].set_exception(ConnectionLost("inproc channel closed"))


class InProcNetwork:
    """A namespace of in-process listeners, keyed by port. Tests share ``DEFAULT_NETWORK``."""

    def __init__(self) -> None:
        self.listeners: dict[int, Callable[[Channel], Awaitable[None]]] = {}
        self._ports = itertools.count(20000)


DEFAULT_NETWORK = InProcNetwork()


class _InProcListener(Listener):
    def __init__(self, network: InProcNetwork, host: str, port: int):
        self._network = network
        self._port = port
        self.address = f"{host}:{port}"

    def close(self) -> None:
        self._network.listeners.pop(self._port, None)


class InProcTransport(Transport):
    """Connections inside one event loop; ``transport="inproc"``."""

    name = "inproc"

    def __init__(self, network: InProcNetwork = DEFAULT_NETWORK):
        self._network = network
        self._handlers: set[asyncio.Task] = set()

    async def listen(self, host: str, port: int, on_channel: Callable[[Channel], Awaitable[None]]) -> Listener:
        if port == 0:
            port = next(p for p in self._network._ports if p not in self._network.listeners)
        if port in self._network.listeners:
            raise OSError(f"inproc port {port} already in use")
        self._network.listeners[port] = on_channel
        return _InProcListener(self._network, host, port)

    async def connect(self, host: str, port: int, timeout: float) -> Channel:
        on_channel = self._network.listeners.get(port)
        if on_channel is None:
            raise ConnectionLost(f"nothing listens on inproc {host}:{port}")
        client, server = InProcChannel(), InProcChannel()
        client.peer, server.peer = server, client
        task = asyncio.get_running_loop().create_task(on_channel(server))
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)
        return client
