"""Cancellation and failure of one transfer never touch another one on the same connection.

A decode worker receives every transfer from one prefill worker over one connection. If a
cancelled send left half a frame on it, the receiver would read the next transfer's bytes as
payload: silent corruption of someone else's KV. These tests cancel a send in the middle of its
payload while another transfer shares the connection, and compare bytes.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket

import msgspec
import pytest
import torch

from common.engine.kv.kv_cache import KVCache
from kvt_support import AUTH, LAYOUT, random_cache
from kvtransfer import ConnectionLost, KVReceiver, KVSender, KVTransferConfig, TransferAborted, make_transport
from kvtransfer.config import parse_address
from kvtransfer.socket_io import FrameWriter

pytestmark = pytest.mark.asyncio(loop_scope="session")

BOUND = 60.0  # generous: a hang fails the test, a slow machine does not
# 256 KiB blocks: a 40-block frame (10 MiB) is far larger than any socket buffer, so a cancel
# right after the send started lands in the middle of its payload.
BIG = msgspec.structs.replace(LAYOUT, block_size=64, num_kv_heads=8, head_dim=32)
BIG_BLOCKS = 64


async def test_cancel_mid_payload_leaves_the_other_transfer_intact(transport):
    cfg = KVTransferConfig(transport=transport)
    receiver = KVReceiver(KVCache(BIG, BIG_BLOCKS), cfg, auth=AUTH)
    await receiver.start()
    sender = KVSender(random_cache(3, BIG, BIG_BLOCKS), cfg, auth=AUTH)
    try:
        rx_a = receiver.expect("a", list(range(0, 40)))
        rx_b = receiver.expect("b", [40, 41, 42, 43])
        tx_a = await sender.begin(rx_a.transfer_id, receiver.address)
        tx_b = await sender.begin(rx_b.transfer_id, receiver.address)
        assert tx_a._conn is tx_b._conn, "both transfers must share one connection"

        send_a = asyncio.create_task(tx_a.send_blocks(list(range(0, 40)), list(range(0, 40))))
        await asyncio.sleep(0)  # A's frame starts going out
        send_b = asyncio.create_task(tx_b.send_blocks([50, 51, 52, 53], [40, 41, 42, 43]))  # queued behind A
        await asyncio.sleep(0)
        send_a.cancel()
        with pytest.raises(asyncio.CancelledError):
            await send_a

        await asyncio.wait_for(send_b, BOUND)
        await asyncio.wait_for(tx_b.finish({"first_token": [5]}), BOUND)
        assert (await asyncio.wait_for(rx_b.wait(), BOUND)).metadata == {"first_token": [5]}
        assert torch.equal(receiver.cache.buffer[40:44], sender.cache.buffer[50:54]), "B corrupted by A's cancel"

        with pytest.raises(TransferAborted, match="sender cancelled"):
            await asyncio.wait_for(rx_a.wait(), BOUND)  # told at once, not at its deadline
        assert receiver.num_pending == 0

        # The connection is still good for new transfers.
        rx_c = receiver.expect("c", [45])
        tx_c = await sender.begin(rx_c.transfer_id, receiver.address)
        assert tx_c._conn is tx_b._conn
        await tx_c.send_blocks([1], [45])
        await asyncio.wait_for(tx_c.finish(), BOUND)
        await asyncio.wait_for(rx_c.wait(), BOUND)
        assert torch.equal(receiver.cache.buffer[45], sender.cache.buffer[1])
    finally:
        await sender.close()
        await receiver.close()


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
async def test_close_ends_a_pending_receive(transport):
    """Closing a channel wakes a receive waiting on it, on either event loop (the stdlib loop
    does not wake a ``sock_recv_into`` whose socket was closed)."""
    net = make_transport(transport)
    accepted: asyncio.Queue = asyncio.Queue()

    async def serve(channel):
        await accepted.put(channel)
        await asyncio.Event().wait()  # keep the connection open, never send

    listener = await net.listen("127.0.0.1", 0, serve)
    client = await net.connect(*parse_address(listener.address), 5.0)
    server_side = await asyncio.wait_for(accepted.get(), BOUND)
    try:
        waiting = asyncio.create_task(client.recv_header())
        await asyncio.sleep(0)
        client.close()
        with pytest.raises(ConnectionLost):
            await asyncio.wait_for(waiting, BOUND)
    finally:
        client.close()
        server_side.close()
        listener.close()
        net.close()


# -- FrameWriter on a real socket pair --------------------------------------------------------


@contextlib.asynccontextmanager
async def socket_pair(stall_timeout: float = 60.0):
    """A writer on one end of a socket pair whose other end does not read until told."""
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    stalled: list[ConnectionLost] = []
    writer = FrameWriter(a, stall_timeout, stalled.append)
    try:
        yield writer, b, stalled
    finally:
        writer.fail(ConnectionLost("test over"))
        a.close()
        b.close()


async def read_all(sock: socket.socket, nbytes: int) -> bytes:
    loop = asyncio.get_running_loop()
    data = bytearray()
    while len(data) < nbytes:
        chunk = await asyncio.wait_for(loop.sock_recv(sock, nbytes - len(data)), BOUND)
        assert chunk, "peer closed early"
        data += chunk
    return bytes(data)


async def test_writer_withdraws_a_frame_not_started_and_finishes_one_started():
    async with socket_pair() as (writer, peer, _):
        big = bytes(range(256)) * (64 * 1024)  # 16 MiB: more than the socket buffers hold
        first = asyncio.create_task(writer.send([b"A" * 8, big]))
        await asyncio.sleep(0)
        second = asyncio.create_task(writer.send([b"B" * 8]))
        third = asyncio.create_task(writer.send([b"C" * 8]))
        await asyncio.sleep(0)
        first.cancel()   # started: goes out whole
        second.cancel()  # not started: withdrawn
        received = await read_all(peer, 8 + len(big) + 8)
        with pytest.raises(asyncio.CancelledError):
            await first
        with pytest.raises(asyncio.CancelledError):
            await second
        await asyncio.wait_for(third, BOUND)
        assert received == b"A" * 8 + big + b"C" * 8


async def test_writer_declares_a_stalled_peer_lost():
    async with socket_pair(stall_timeout=0.5) as (writer, _peer, stalled):  # the peer never reads
        with pytest.raises(ConnectionLost, match="read nothing"):
            await asyncio.wait_for(writer.send([b"x" * (32 << 20)]), BOUND)
        assert stalled and "read nothing" in str(stalled[0])
        with pytest.raises(ConnectionLost):
            await writer.send([b"later"])
