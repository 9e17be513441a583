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

from common.engine.kv.kv_cache import KVCache
from kvt_support import AUTH, LAYOUT, NUM_BLOCKS, SHARDS, random_cache, wait_until
from kvtransfer import KVReceiver, KVTransferConfig, PeerLost, TransferAborted, TransferTimeout, make_transport
from kvtransfer.config import parse_address
from kvtransfer.handshake import client_handshake
from kvtransfer.messages import Blocks, Done, encode
from kvtransfer.regions import run_bytes
from kvtransfer.transport_ucx import UcxChannel

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
        await client_handshake(channel, SHARDS, False, 5.0, AUTH)
        return cls(channel, random_cache(1))

    async def announce(self, transfer_id: str, first_dst: int, src: int, count: int) -> torch.Tensor:
        """Send a Blocks header only; the payload (returned) is still owed."""
        region = run_bytes(self.cache, src, count)
        header = encode(Blocks(transfer_id, first_dst, count, region.numel()))
        if isinstance(self.channel, UcxChannel):  # the header says which UCX message carries it
            self.channel._send_seq += 1
            self.owed = self.channel._send_seq
            await self.channel._control.writer.send(self.channel._control.frame(self.owed, header))
        else:
            await self.channel.send(header)
        return region

    async def pay_ucx(self, payload: torch.Tensor) -> None:
        """UCX only: the owed payload, late."""
        channel = self.channel
        request = channel._ep.tag_send(channel._ucx.array(payload.numpy()), channel._tag(self.owed))
        await channel._ucx.wait(request.future)

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
    receiver = KVReceiver(KVCache(LAYOUT, NUM_BLOCKS), KVTransferConfig(transport=transport, **config), auth=AUTH)
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
            payload = await sender.announce(rx.transfer_id, 3, src=10, count=3)
            half = payload.numel() // 2
            await sender.raw_bytes(payload[:half])
            await wait_until(lambda: rx.landing and receiver.cache.buffer[3].any())

            assert receiver.abort(rx.transfer_id, "client left") is rx
            await asyncio.wait_for(rx.settled(), SETTLE_BOUND)
            with pytest.raises(TransferAborted, match="client left"):
                await rx.wait()
            canary = canary_like(receiver.cache.buffer[dst])
            receiver.cache.buffer[dst] = canary  # another request owns these blocks now

            await sender.raw_bytes(payload[half:])  # the sender did not know yet
            rx_next = receiver.expect("next", [9])
            await sender.complete(rx_next.transfer_id, 9, src=2, count=1)
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
            payload = await sender.announce(rx.transfer_id, 6, src=1, count=2)
            await sender.raw_bytes(payload[:100])
            await asyncio.wait_for(rx.settled(), SETTLE_BOUND)  # no more bytes come before this
            with pytest.raises(TransferTimeout):
                await rx.wait()
            canary = canary_like(receiver.cache.buffer[[6, 7]])
            receiver.cache.buffer[[6, 7]] = canary
            await sender.raw_bytes(payload[100:])
            rx_next = receiver.expect("next", [8])
            await sender.complete(rx_next.transfer_id, 8, src=3, count=1)
            await asyncio.wait_for(rx_next.wait(), SETTLE_BOUND)
            assert torch.equal(receiver.cache.buffer[[6, 7]], canary)
        finally:
            sender.channel.close()


async def test_tcp_sender_silent_mid_payload_is_lost_after_io_timeout_but_an_idle_one_is_not():
    """A sender that stops inside a payload (frozen: its kernel keeps the socket open) holds the
    connection, its reader task and staging buffer for ``io_timeout``, no longer; between frames a
    connection may idle as long as it likes."""
    async with receiver_for("tcp", io_timeout=0.5) as receiver:
        sender = await SlowSender.connect("tcp", receiver.address)
        try:
            await asyncio.sleep(1.5)  # idle between frames, three times io_timeout
            rx_first = receiver.expect("after idling", [2])
            await sender.complete(rx_first.transfer_id, 2, src=4, count=1)
            await asyncio.wait_for(rx_first.wait(), SETTLE_BOUND)

            rx = receiver.expect("frozen", [6, 7])
            payload = await sender.announce(rx.transfer_id, 6, src=1, count=2)
            await sender.raw_bytes(payload[:100])
            with pytest.raises(PeerLost, match="sent nothing"):
                await asyncio.wait_for(rx.wait(), SETTLE_BOUND)  # its deadline is 120 s away
            await wait_until(lambda: not receiver._conns, what="the connection's end")
        finally:
            sender.channel.close()


async def test_tcp_sender_silent_inside_a_frames_length_is_lost_after_io_timeout():
    """Between frames a connection idles as long as it likes, but a frame begun -- two bytes of its
    length, say -- must complete within ``io_timeout`` like the rest of it."""
    async with receiver_for("tcp", io_timeout=0.5) as receiver:
        sender = await SlowSender.connect("tcp", receiver.address)
        try:
            await wait_until(lambda: len(receiver._conns) == 1, what="the connection")
            await sender.raw_bytes(torch.zeros(2, dtype=torch.uint8))
            await wait_until(lambda: not receiver._conns, what="the connection's end")
        finally:
            sender.channel.close()


async def test_ucx_abort_while_payload_owed_drains_it_elsewhere():
    """UCX moves payload bytes without the event loop. An announced payload that has not come
    yet is cancelled and, when it comes, drained into one byte: the handle settles at once, the
    sender's late payload lands nowhere (and completes), and the connection goes on serving."""
    async with receiver_for("ucx") as receiver:
        dst = [11, 12]
        rx = receiver.expect("owed", dst)
        sender = await SlowSender.connect("ucx", receiver.address)
        try:
            payload = await sender.announce(rx.transfer_id, 11, src=4, count=2)
            await wait_until(lambda: rx.landing)
            receiver.abort(rx.transfer_id, "client left")
            await asyncio.wait_for(rx.settled(), SETTLE_BOUND)
            with pytest.raises(TransferAborted):
                await rx.wait()
            canary = canary_like(receiver.cache.buffer[dst])
            receiver.cache.buffer[dst] = canary
            await asyncio.wait_for(sender.pay_ucx(payload), SETTLE_BOUND)
            rx_next = receiver.expect("next", [13])
            await sender.complete(rx_next.transfer_id, 13, src=5, count=1)
            await asyncio.wait_for(rx_next.wait(), SETTLE_BOUND)
            assert torch.equal(receiver.cache.buffer[13], sender.cache.buffer[5])
            assert torch.equal(receiver.cache.buffer[dst], canary), "bytes landed after the handle settled"
        finally:
            sender.channel.close()


@pytest.mark.parametrize("transport", ["inproc", "tcp", "ucx"])
async def test_abort_with_nothing_landing_settles_at_once(transport):
    async with receiver_for(transport) as receiver:
        rx = receiver.expect("idle", [1, 2])
        handle = receiver.abort(rx.transfer_id, "gave up")
        assert handle is rx and receiver.abort(rx.transfer_id) is None  # not in flight any more
        await asyncio.wait_for(rx.settled(), SETTLE_BOUND)
        with pytest.raises(TransferAborted, match="gave up"):
            await rx.wait()
        assert receiver.num_pending == 0
