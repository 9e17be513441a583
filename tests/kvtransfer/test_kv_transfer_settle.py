"""A failed transfer resolves only once nothing more can land in its blocks (the canary checks).

The decode worker frees a transfer's blocks as soon as its handle has settled, and another request
may get them at once. So after ``settled()`` the receiver must never write into them again, even
though the sender is still in the middle of a payload: a pattern written into the blocks right
after the handle settled must survive everything the sender does afterwards.
"""
from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from common.engine.kv_cache import KVCache
from kvt_support import LAYOUT, NUM_BLOCKS, random_cache, wait_until
from kvtransfer import ConnectionLost, KVReceiver, KVTransferConfig, TransferAborted, TransferTimeout, make_transport
from kvtransfer.config import parse_address
from kvtransfer.handshake import client_handshake
from kvtransfer.messages import Blocks, Done, encode
from kvtransfer.regions import run_bytes

pytestmark = pytest.mark.asyncio(loop_scope="session")

SETTLE_BOUND = 60.0  # generous: a hang fails the test, a slow machine does not


def canary_like(blocks: torch.Tensor) -> torch.Tensor:
    return torch.full_like(blocks, 7.25)


class SlowSender:
    """A sender driven by hand, so a test can stop it in the middle of a payload."""

    def __init__(self, channel, cache: KVCache):
        self.channel = channel
        self.cache = cache

    @classmethod
    async def connect(cls, transport: str, address: str) -> "SlowSender":
        host, port = parse_address(address)
        channel = await make_transport(transport).connect(host, port, 5.0)
        await client_handshake(channel, LAYOUT, False, 5.0)
        return cls(channel, random_cache(1))

    async def announce(self, transfer_id: str, first_dst: int, src: int, count: int) -> torch.Tensor:
        """Send a Blocks header only; the payload (returned) is still owed."""
        region = run_bytes(self.cache, src, count)
        await self.channel.send(encode(Blocks(transfer_id, first_dst, count, region.numel())))
        return region

    async def raw_bytes(self, data: torch.Tensor) -> None:
        """TCP only: part of a payload, straight onto the socket (no frame around it)."""
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(self.channel._sock, memoryview(data.numpy()).cast("B"))

    async def complete(self, transfer_id: str, first_dst: int, src: int, count: int) -> None:
        region = run_bytes(self.cache, src, count)
        await self.channel.send(encode(Blocks(transfer_id, first_dst, count, region.numel())), region)
        await self.channel.send(encode(Done(transfer_id, {})))


@contextlib.asynccontextmanager
async def receiver_for(transport: str, **config):
    receiver = KVReceiver(KVCache(LAYOUT, NUM_BLOCKS), KVTransferConfig(transport=transport, **config))
    await receiver.start()
    try:
        yield receiver
    finally:
        await receiver.close()


async def test_tcp_abort_mid_payload_diverts_the_rest_and_keeps_the_connection():
    """Half a payload has landed when the transfer is aborted: the handle settles at once, the rest
    of the payload is read and dropped, and the same connection then carries another transfer."""
    async with receiver_for("tcp") as receiver:
        dst = [3, 4, 5]
        rx = receiver.expect("slow", dst)
        sender = await SlowSender.connect("tcp", receiver.address)
        try:
            payload = await sender.announce("slow", 3, src=10, count=3)
            half = payload.numel() // 2
            await sender.raw_bytes(payload[:half])
            await wait_until(lambda: rx.landing and receiver.cache.buffer[3].any())

            assert receiver.abort("slow", "client left") is rx
            await asyncio.wait_for(rx.settled(), SETTLE_BOUND)
            with pytest.raises(TransferAborted, match="client left"):
                await rx.wait()
            canary = canary_like(receiver.cache.buffer[dst])
            receiver.cache.buffer[dst] = canary  # another request owns these blocks now

            await sender.raw_bytes(payload[half:])  # the sender did not know yet
            rx_next = receiver.expect("next", [9])
            await sender.complete("next", 9, src=2, count=1)
            await asyncio.wait_for(rx_next.wait(), SETTLE_BOUND)
            assert torch.equal(receiver.cache.buffer[9], sender.cache.buffer[2]), "framing lost after diversion"
            assert torch.equal(receiver.cache.buffer[dst], canary), "bytes landed after the handle settled"
        finally:
            sender.channel.close()


async def test_tcp_deadline_mid_payload_settles_without_waiting_for_the_sender():
    async with receiver_for("tcp") as receiver:
        rx = receiver.expect("late", [6, 7], timeout=1.0)
        sender = await SlowSender.connect("tcp", receiver.address)
        try:
            payload = await sender.announce("late", 6, src=1, count=2)
            await sender.raw_bytes(payload[:100])
            await asyncio.wait_for(rx.settled(), SETTLE_BOUND)  # no more bytes come before this
            with pytest.raises(TransferTimeout):
                await rx.wait()
            canary = canary_like(receiver.cache.buffer[[6, 7]])
            receiver.cache.buffer[[6, 7]] = canary
            await sender.raw_bytes(payload[100:])
            rx_next = receiver.expect("next", [8])
            await sender.complete("next", 8, src=3, count=1)
            await asyncio.wait_for(rx_next.wait(), SETTLE_BOUND)
            assert torch.equal(receiver.cache.buffer[[6, 7]], canary)
        finally:
            sender.channel.close()


async def test_ucx_abort_while_payload_owed_closes_that_connection_after_grace():
    """UCX moves payload bytes without the event loop, so nothing can be diverted: the handle
    waits (at most ``abort_grace``), then closes the sender's connection, and settles once the
    pending receive has ended. The sender's late payload lands nowhere."""
    async with receiver_for("ucx", abort_grace=0.5) as receiver:
        dst = [11, 12]
        rx = receiver.expect("owed", dst)
        sender = await SlowSender.connect("ucx", receiver.address)
        try:
            payload = await sender.announce("owed", 11, src=4, count=2)
            await wait_until(lambda: rx.landing)
            receiver.abort("owed", "client left")
            await asyncio.wait_for(rx.settled(), SETTLE_BOUND)
            with pytest.raises(TransferAborted):
                await rx.wait()
            canary = canary_like(receiver.cache.buffer[dst])
            receiver.cache.buffer[dst] = canary
            with contextlib.suppress(ConnectionLost):
                await asyncio.wait_for(sender.channel.send(encode(Blocks("owed", 11, 2, payload.numel())), payload), 5)
            # The receiver keeps serving: a fresh connection carries the next transfer.
            rx_next = receiver.expect("next", [13])
            other = await SlowSender.connect("ucx", receiver.address)
            await other.complete("next", 13, src=5, count=1)
            await asyncio.wait_for(rx_next.wait(), SETTLE_BOUND)
            other.channel.close()
            assert torch.equal(receiver.cache.buffer[dst], canary), "bytes landed after the handle settled"
        finally:
            sender.channel.close()


@pytest.mark.parametrize("transport", ["inproc", "tcp", "ucx"])
async def test_abort_with_nothing_landing_settles_at_once(transport):
    async with receiver_for(transport) as receiver:
        rx = receiver.expect("idle", [1, 2])
        handle = receiver.abort("idle", "gave up")
        assert handle is rx and receiver.abort("idle") is None  # not in flight any more
        await asyncio.wait_for(rx.settled(), SETTLE_BOUND)
        with pytest.raises(TransferAborted, match="gave up"):
            await rx.wait()
        assert receiver.num_pending == 0
