"""An in-process KV transport whose receiver cannot divert a payload, and whose next payload the
test can hold half-written -- what UCX does to a transfer given up mid-payload, on cue.

Over TCP the receiver drops the rest of a payload whose transfer failed at once, so a decode worker
that freed the blocks early could never be caught there.  Here, as with UCX, ``divert_payload()``
says no: the transfer settles only once the held payload has ended (``PayloadHold.release()``,
after which its second half lands) or its connection was closed (the receiver's ``abort_grace``).

    hold = PayloadHold()
    transport = HeldInProcTransport(hold)       # for the KVReceiver and the KVSender alike
    hold.arm()                                  # the next payload received stops half-way
    await hold.holding.wait()                   # ... it has: half of it is in the blocks
    hold.release()                              # the other half lands, then the payload ends
"""
from __future__ import annotations

import asyncio

import torch

from kvtransfer.errors import ConnectionLost, ProtocolError
from kvtransfer.transport_base import Channel
from kvtransfer.transport_inproc import InProcChannel, InProcNetwork, InProcTransport


class PayloadHold:
    """Which payload to hold and when to let it go (event loop only)."""

    def __init__(self) -> None:
        self.armed = False
        self.holding = asyncio.Event()  # a payload is held half-written
        self.released = asyncio.Event()

    def arm(self) -> None:
        self.armed = True

    def release(self) -> None:
        self.released.set()


class HeldChannel(InProcChannel):
    """The receiving end of a connection: lands payloads, holding the one ``PayloadHold`` says."""

    def __init__(self, hold: PayloadHold) -> None:
        super().__init__()
        self.hold = hold
        self._closing = asyncio.Event()

    def divert_payload(self) -> bool:
        return False  # as with UCX: the bytes move without the event loop and cannot be stopped

    async def recv_payload_into(self, region: torch.Tensor) -> None:
        if not self.hold.armed:
            return await super().recv_payload_into(region)
        self.hold.armed = False
        payload, consumed = self._take_payload()
        try:
            if payload.numel() != region.numel():
                raise ProtocolError(f"payload of {payload.numel()} bytes for a {region.numel()}-byte region")
            half = region.numel() // 2
            region[:half].copy_(payload[:half])
            self.hold.holding.set()
            released = asyncio.ensure_future(self.hold.released.wait())
            closing = asyncio.ensure_future(self._closing.wait())
            try:
                await asyncio.wait([released, closing], return_when=asyncio.FIRST_COMPLETED)
            finally:
                released.cancel()
                closing.cancel()
            if self._closing.is_set():  # closed: the receive ends and nothing more is written
                raise ConnectionLost("inproc channel closed mid-payload")
            region[half:].copy_(payload[half:])
        finally:
            if not consumed.done():
                consumed.set_result(None)

    def close(self) -> None:
        self._closing.set()
        super().close()


class HeldInProcTransport(InProcTransport):
    """``InProcTransport`` (on a network of its own) whose accepted connections are ``HeldChannel``s."""

    def __init__(self, hold: PayloadHold, network: InProcNetwork | None = None):
        super().__init__(network or InProcNetwork())
        self.hold = hold

    async def connect(self, host: str, port: int, timeout: float) -> Channel:
        on_channel = self._network.listeners.get(port)
        if on_channel is None:
            raise ConnectionLost(f"nothing listens on inproc {host}:{port}")
        client, server = InProcChannel(), HeldChannel(self.hold)
        client.peer, server.peer = server, client
        task = asyncio.get_running_loop().create_task(on_channel(server))
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)
        return client
