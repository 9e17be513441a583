"""Raw bytes at a KV port (TCP, and the TCP half of UCX): garbage ends that connection only.

Anyone who can reach the port can send anything. Absurd lengths, malformed or truncated frames,
and frames out of place must close that one connection, before any allocation of the announced
size and before a byte lands in the cache, while the receiver goes on serving other senders.
"""
from __future__ import annotations

import asyncio
import struct

import pytest
import torch

from common.engine.kv.kv_cache import KVCache
from kvt_support import AUTH, LAYOUT, NUM_BLOCKS, SHARDS, random_cache
from kvtransfer import KVReceiver, KVSender, KVTransferConfig, PeerLost, make_transport
from kvtransfer.config import parse_address
from kvtransfer.handshake import client_handshake
from kvtransfer.messages import Blocks, Hello, encode

pytestmark = pytest.mark.asyncio(loop_scope="session")

BOUND = 60.0


def framed(transport: str, header: bytes, length: int | None = None, seq: int = 0) -> bytes:
    """One frame as the transport puts it on TCP (UCX adds the payload number)."""
    length = len(header) if length is None else length
    prefix = struct.pack("!I", length) if transport == "tcp" else struct.pack("!IQ", length, seq)
    return prefix + header


GARBAGE = {
    "absurd header length": lambda t: framed(t, b"x" * 16, length=0xFFFFFFFF),
    "empty header": lambda t: framed(t, b""),
    "msgpack, not a message": lambda t: framed(t, b"\x93\x01\x02"),
    "truncated, then closed": lambda t: framed(t, encode(Hello(layout=LAYOUT, nonce=bytes(32))))[:-3],
    "payload before the handshake": lambda t: framed(t, encode(Blocks("x", 1, 1, LAYOUT.block_nbytes)), seq=1),
}


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
@pytest.mark.parametrize("garbage", list(GARBAGE), ids=list(GARBAGE))
async def test_raw_garbage_ends_that_connection_only(transport, garbage):
    cfg = KVTransferConfig(transport=transport)
    receiver = KVReceiver(KVCache(LAYOUT, NUM_BLOCKS), cfg, auth=AUTH)
    host, port = parse_address(await receiver.start())
    sender = KVSender(random_cache(1), cfg, auth=AUTH)
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(GARBAGE[garbage](transport))
        await writer.drain()
        writer.write_eof()
        try:
            rest = await asyncio.wait_for(reader.read(), BOUND)
        except ConnectionResetError:  # closed with our garbage unread: also a close
            rest = b""
        assert rest == b"", "receiver must close the offending connection without answering"
        writer.close()
        assert not receiver.cache.buffer.any()

        rx = receiver.expect("ok", [1])
        tx = await sender.begin(rx.transfer_id, receiver.address)
        await tx.send_blocks([2], [1])
        await tx.finish()
        await asyncio.wait_for(rx.wait(), BOUND)
    finally:
        await sender.close()
        await receiver.close()


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
async def test_payload_length_that_disagrees_with_the_layout_is_refused(transport):
    """After a valid handshake, a Blocks header claiming 1 TiB is refused before a byte of it is read."""
    cfg = KVTransferConfig(transport=transport)
    receiver = KVReceiver(KVCache(LAYOUT, NUM_BLOCKS), cfg, auth=AUTH)
    net = make_transport(transport)
    rx = receiver.expect("big", [1, 2])
    await receiver.start()
    channel = await net.connect(*parse_address(receiver.address), 5.0)
    cache = random_cache(1)
    try:
        await client_handshake(channel, SHARDS, False, 5.0, AUTH)
        block = cache.buffer[3].reshape(-1).view(torch.uint8)
        await channel.send(encode(Blocks(rx.transfer_id, 1, 1, block.numel())), block)  # binds the transfer here
        await channel.send(encode(Blocks(rx.transfer_id, 2, 1, 1 << 40)))  # no payload follows, none is read
        with pytest.raises(PeerLost, match="announces 1099511627776 bytes"):
            await asyncio.wait_for(rx.wait(), BOUND)
        assert not receiver.cache.buffer[2].any()
    finally:
        channel.close()
        net.close()
        await receiver.close()
