"""Raw bytes at the TCP receiver: absurd lengths and truncated frames end that connection only."""
from __future__ import annotations

import asyncio
import struct

import pytest

from common.engine.kv_cache import KVCache
from kvt_support import LAYOUT, NUM_BLOCKS, random_cache
from kvtransfer import KVReceiver, KVSender, KVTransferConfig, PeerLost
from kvtransfer.messages import Blocks, Hello, encode

pytestmark = pytest.mark.asyncio(loop_scope="session")


def frame(header: bytes) -> bytes:
    return struct.pack("!I", len(header)) + header


@pytest.mark.parametrize("garbage", [
    struct.pack("!I", 0xFFFFFFFF) + b"x" * 16,              # absurd header length
    struct.pack("!I", 0),                                     # empty header
    frame(b"\x93\x01\x02"),                                   # msgpack, but not a message
    frame(encode(Hello(layout=LAYOUT)))[:-3],                 # truncated, then the peer closes
])
async def test_raw_garbage_ends_that_connection_only(garbage):
    cfg = KVTransferConfig(transport="tcp")
    receiver = KVReceiver(KVCache(LAYOUT, NUM_BLOCKS), cfg)
    host, port = (await receiver.start()).split(":")
    sender = KVSender(random_cache(1), cfg)
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(garbage)
        await writer.drain()
        writer.write_eof()
        try:
            rest = await reader.read()
        except ConnectionResetError:  # closed with our garbage unread: also a close
            rest = b""
        assert rest == b"", "receiver must close the offending connection without answering"
        writer.close()

        rx = receiver.expect("ok", [1])
        tx = await sender.begin("ok", receiver.address)
        await tx.send_blocks([2], [1])
        await tx.finish()
        await rx.wait()
    finally:
        await sender.close()
        await receiver.close()


async def test_payload_length_that_disagrees_with_reservation_is_refused():
    """After a valid handshake, a Blocks header claiming 1 TiB is rejected before reading a byte of it."""
    cfg = KVTransferConfig(transport="tcp")
    receiver = KVReceiver(KVCache(LAYOUT, NUM_BLOCKS), cfg)
    host, port = (await receiver.start()).split(":")
    rx = receiver.expect("big", [1])
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(frame(encode(Hello(layout=LAYOUT))))
        await reader.readexactly(4)  # Welcome frame length
        writer.write(frame(encode(Blocks("big", 1, 1, LAYOUT.block_nbytes))))  # binds "big" here
        writer.write(b"\0" * LAYOUT.block_nbytes)
        writer.write(frame(encode(Blocks("big", 1, 1, 1 << 40))))
        await writer.drain()
        with pytest.raises(PeerLost, match="announces 1099511627776 bytes"):
            await rx.wait()
        writer.close()
    finally:
        await receiver.close()
