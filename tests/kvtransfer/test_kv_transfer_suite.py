"""The shared suite: every test runs against the inproc, tcp and ucx transports."""
from __future__ import annotations

import asyncio
import contextlib

import msgspec
import pytest
import torch

from common.engine.kv.block_pool import BlockPool
from kvt_support import AUTH, LAYOUT, NUM_BLOCKS, SHARDS, random_cache, wait_until
from kvtransfer import (
    ChecksumMismatch, ConnectionLost, HandshakeError, KVReceiver, KVSender, KVTransferConfig, PeerLost,
    TransferAborted, TransferError, TransferTimeout, make_transport,
)
from kvtransfer import regions
from kvtransfer.handshake import server_handshake
from kvtransfer.messages import Blocks, decode, encode

# ucxx binds its context to the first event loop that uses it, so the suite shares one loop.
pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow(seconds=11)]


def assert_copied(sender: KVSender, receiver: KVReceiver, src: list[int], dst: list[int]) -> None:
    assert torch.equal(receiver.cache.buffer[dst], sender.cache.buffer[src]), "blocks differ after transfer"


async def test_round_trip_noncontiguous_overlapping_ids(make_pair):
    pool = BlockPool(NUM_BLOCKS)
    async with make_pair() as (sender, receiver):
        held = pool.allocate(3)  # other requests own some blocks, so the reservation is scattered
        reserved = pool.allocate(6)
        pool.free(held[1:2])
        dst = [b.block_id for b in reserved]
        src = [2, 3, 4, 9, 5, 6]  # overlaps dst ids partially; runs break on either side
        rx = receiver.expect("r1", dst)
        tx = await sender.begin(rx.transfer_id, receiver.address)
        await tx.send_blocks(src, dst)
        await tx.finish({"first_token": [7], "note": "ok"})
        result = await rx.wait()
        assert result.metadata == {"first_token": [7], "note": "ok"}
        assert result.nbytes == len(dst) * LAYOUT.block_nbytes
        assert_copied(sender, receiver, src, dst)
        untouched = sorted(set(range(NUM_BLOCKS)) - set(dst))
        assert not receiver.cache.buffer[untouched].any(), "bytes landed outside the reservation"
        pool.free(reserved)
        pool.check_integrity()
        assert receiver.num_pending == 0


async def test_an_fp8_cache_ships_byte_for_byte(make_pair):
    """``--kv-cache-dtype fp8``: a block is a quarter of an fp32 one's bytes and arrives as it was."""
    fp8 = msgspec.structs.replace(LAYOUT, dtype="fp8")
    assert fp8.block_nbytes * 4 == LAYOUT.block_nbytes
    async with make_pair(layout=fp8) as (sender, receiver):
        assert receiver.cache.buffer.dtype == torch.float8_e4m3fn
        src, dst = [1, 2, 7], [4, 5, 0]
        rx = receiver.expect("fp8", dst)
        tx = await sender.begin(rx.transfer_id, receiver.address)
        await tx.send_blocks(src, dst)
        await tx.finish({})
        assert (await rx.wait()).nbytes == len(dst) * fp8.block_nbytes
        sent, arrived = sender.cache.buffer.view(torch.uint8), receiver.cache.buffer.view(torch.uint8)
        assert sent[src].any() and torch.equal(arrived[dst], sent[src])
        assert not arrived[[b for b in range(NUM_BLOCKS) if b not in dst]].any()


async def test_chunks_interleaved_with_other_transfers(make_pair):
    async with make_pair() as (sender, receiver):
        rx_a = receiver.expect("a", [10, 11, 12, 13])
        rx_b = receiver.expect("b", [20, 22, 24])
        tx_a = await sender.begin(rx_a.transfer_id, receiver.address)
        tx_b = await sender.begin(rx_b.transfer_id, receiver.address)
        await tx_a.send_blocks([0, 1], [10, 11])  # chunk 1 of a
        await tx_b.send_blocks([5], [20])
        await tx_a.send_blocks([2], [12])  # chunk 2 of a
        await tx_b.send_blocks([6, 7], [22, 24])
        await tx_b.finish({"first_token": [2]})
        await tx_a.send_blocks([3], [13])  # chunk 3 of a, after b completed
        await tx_a.finish({"first_token": [1]})
        assert (await rx_a.wait()).metadata == {"first_token": [1]}
        assert (await rx_b.wait()).metadata == {"first_token": [2]}
        assert_copied(sender, receiver, [0, 1, 2, 3, 5, 6, 7], [10, 11, 12, 13, 20, 22, 24])


async def test_concurrent_transfers_to_one_receiver(make_pair, transport):
    async with make_pair() as (sender, receiver):
        other = KVSender(random_cache(2), sender.config, auth=AUTH)  # a second prefill worker
        try:
            async def ship(s: KVSender, name: str, src: list[int], dst: list[int]):
                rx = receiver.expect(name, dst)
                tx = await s.begin(rx.transfer_id, receiver.address)
                for i in range(0, len(src), 2):
                    await tx.send_blocks(src[i : i + 2], dst[i : i + 2])
                await tx.finish({"first_token": [len(name)]})
                return await rx.wait()

            jobs = [(sender if i % 2 else other, f"req-{i}", [i, i + 8, i + 16], [3 * i, 3 * i + 1, 3 * i + 2])
                    for i in range(8)]
            results = await asyncio.gather(*(ship(*job) for job in jobs))
            assert len({r.transfer_id for r in results}) == 8
            for s, _, src, dst in jobs:
                assert_copied(s, receiver, src, dst)
        finally:
            await other.close()


async def test_handshake_mismatch_names_field_and_sends_nothing(make_pair):
    import msgspec

    wrong = msgspec.structs.replace(LAYOUT, dtype="float16", head_dim=16)
    async with make_pair(sender_layout=wrong) as (sender, receiver):
        rx = receiver.expect("h", [1, 2])
        with pytest.raises(HandshakeError, match="dtype: 'float32' != 'float16'.*head_dim"):
            await sender.begin(rx.transfer_id, receiver.address)
        assert not receiver.cache.buffer.any()
        assert not rx.done()
        receiver.abort(rx.transfer_id)
        with pytest.raises(TransferAborted):
            await rx.wait()


async def test_abort_by_receiver_reaches_sender(make_pair):
    async with make_pair() as (sender, receiver):
        rx = receiver.expect("x", [1, 2, 3])
        tx = await sender.begin(rx.transfer_id, receiver.address)
        await tx.send_blocks([4], [1])
        assert receiver.abort(rx.transfer_id, "client disconnected")
        with pytest.raises(TransferAborted, match="client disconnected"):
            await rx.wait()
        with pytest.raises(TransferAborted, match="aborted by receiver"):
            await tx.finish()
        assert tx.done() and isinstance(tx.error, TransferAborted)


async def test_abort_by_sender_reaches_receiver(make_pair):
    async with make_pair() as (sender, receiver):
        rx = receiver.expect("y", [5, 6])
        tx = await sender.begin(rx.transfer_id, receiver.address)
        await tx.send_blocks([0], [5])
        tx.abort("prefill preempted")
        with pytest.raises(TransferAborted, match="aborted by sender: prefill preempted"):
            await rx.wait()
        with pytest.raises(TransferAborted):
            await tx.send_blocks([1], [6])
        assert receiver.num_pending == 0


async def test_the_sender_aborts_a_transfer_by_its_id(make_pair):
    """``KVSender.abort`` (what a prefill worker calls when its request is cancelled): the transfer
    fails on both sides with the reason, or without one when none is given; an unknown id is
    False.  ``describe`` names what carries the bytes to a connected receiver only."""
    async with make_pair() as (sender, receiver):
        assert sender.describe(receiver.address) is None  # not connected yet
        first, second = receiver.expect("a", [1]), receiver.expect("b", [2])
        tx_first = await sender.begin(first.transfer_id, receiver.address)
        tx_second = await sender.begin(second.transfer_id, receiver.address)
        assert sender.describe(receiver.address)
        assert sender.describe("127.0.0.1:1") is None
        assert sender.abort(first.transfer_id, "request cancelled")
        with pytest.raises(TransferAborted, match="^aborted by sender: request cancelled$"):
            await tx_first.finish()
        with pytest.raises(TransferAborted, match="aborted by sender: request cancelled$"):
            await first.wait()
        assert sender.abort(second.transfer_id)
        with pytest.raises(TransferAborted, match="^aborted by sender$"):
            await tx_second.finish()
        assert not sender.abort(second.transfer_id)  # gone once failed
        assert not sender.abort("never-begun")


async def test_receiver_deadline_fails_once_and_tells_sender(make_pair):
    async with make_pair() as (sender, receiver):
        rx = receiver.expect("slow", [1, 2], timeout=1.0)  # how long the test waits, not a bound
        tx = await sender.begin(rx.transfer_id, receiver.address)
        await tx.send_blocks([3], [1])  # the second block never comes
        with pytest.raises(TransferTimeout, match=r"\(1 of 2 blocks missing\)"):
            await rx.wait()
        with pytest.raises(TransferAborted, match="aborted by receiver: receiver deadline passed$"):
            await tx.finish()
        assert receiver.num_pending == 0


async def test_sender_lease_expires_without_ack(transport):
    """A receiver that takes the blocks but never acknowledges: the sender frees after its lease."""
    cfg = KVTransferConfig(transport=transport)
    net = make_transport(transport)
    frames: list[str] = []

    async def silent_receiver(channel):
        await server_handshake(channel, SHARDS, False, 5.0, AUTH)
        with contextlib.suppress(ConnectionLost):
            while True:
                msg = decode(await channel.recv_header())
                frames.append(type(msg).__name__)
                if isinstance(msg, Blocks):
                    await channel.discard_payload(msg.nbytes)

    listener = await net.listen("127.0.0.1", 0, silent_receiver)
    sender = KVSender(random_cache(1), cfg, transport=net, auth=AUTH)
    try:
        tx = await sender.begin("lease", listener.address)
        await tx.send_blocks([1, 2], [1, 2])
        with pytest.raises(TransferTimeout, match="no acknowledgement"):
            await tx.finish({}, lease_timeout=0.5)  # how long the test waits, not a bound
        await wait_until(lambda: len(frames) >= 2)
        assert frames[:2] == ["Blocks", "Done"]
        assert sender.get("lease") is None
    finally:
        await sender.close()
        listener.close()
        net.close()


async def test_done_before_all_blocks_is_an_error(make_pair):
    async with make_pair() as (sender, receiver):
        rx = receiver.expect("short", [1, 2, 3])
        tx = await sender.begin(rx.transfer_id, receiver.address)
        await tx.send_blocks([1, 2], [1, 2])
        with pytest.raises(TransferAborted, match="1 of 3 missing"):
            await tx.finish()
        with pytest.raises(TransferAborted, match="1 of 3 missing"):
            await rx.wait()


async def test_blocks_outside_reservation_are_refused(make_pair):
    async with make_pair() as (sender, receiver):
        rx = receiver.expect("oob", [1, 2])
        tx = await sender.begin(rx.transfer_id, receiver.address)
        await tx.send_blocks([1, 2], [2, 3])  # 3 is not reserved
        with pytest.raises(TransferAborted, match=r"outside the reservation"):
            await rx.wait()
        assert not receiver.cache.buffer[3].any()
        with pytest.raises(TransferAborted):
            await tx.finish()


async def test_unknown_transfer_is_refused_without_harm(make_pair):
    async with make_pair() as (sender, receiver):
        tx = await sender.begin("never-expected", receiver.address)
        await tx.send_blocks([1], [1])
        with pytest.raises(TransferAborted, match="not expected"):
            await tx.finish()
        assert not receiver.cache.buffer.any()


async def test_checksums_round_trip_and_catch_corruption(make_pair, monkeypatch):
    async with make_pair(checksum=True) as (sender, receiver):
        rx = receiver.expect("c1", [1, 2])
        tx = await sender.begin(rx.transfer_id, receiver.address)
        await tx.send_blocks([3, 4], [1, 2])
        await tx.finish()
        await rx.wait()
        assert_copied(sender, receiver, [3, 4], [1, 2])

        real = regions.block_checksums
        monkeypatch.setattr("kvtransfer.sender.block_checksums", lambda r, n: [c ^ 1 for c in real(r, n)])
        rx = receiver.expect("c2", [5])
        tx = await sender.begin(rx.transfer_id, receiver.address)
        await tx.send_blocks([6], [5])
        with pytest.raises(ChecksumMismatch, match=r"blocks \[5\]"):
            await rx.wait()
        with pytest.raises(TransferAborted, match="checksum"):
            await tx.finish()


async def test_garbage_frame_drops_only_that_connection(make_pair, transport):
    async with make_pair() as (sender, receiver):
        rx_bad = receiver.expect("bad", [1, 2])
        bad = KVSender(random_cache(3), sender.config, auth=AUTH)
        tx_bad = await bad.begin(rx_bad.transfer_id, receiver.address)
        await tx_bad.send_blocks([1], [1])  # binds "bad" to that connection
        await tx_bad._conn.channel.send(b"\xc1 not msgpack")
        with pytest.raises(PeerLost, match="protocol error: malformed header"):
            await rx_bad.wait()
        with pytest.raises(TransferError):
            await tx_bad.finish()
        await bad.close()

        # An absurd payload length in a well-formed header: refused before any payload is read.
        bad2 = KVSender(random_cache(3), sender.config, auth=AUTH)
        tx2 = await bad2.begin("absurd", receiver.address)
        await tx2._conn.channel.send(encode(Blocks("absurd", 0, 1, 1 << 40)))
        with pytest.raises(PeerLost):
            await tx2.finish()
        await bad2.close()

        # The receiver keeps serving everyone else.
        rx = receiver.expect("good", [7, 8])
        tx = await sender.begin(rx.transfer_id, receiver.address)
        await tx.send_blocks([9, 10], [7, 8])
        await tx.finish()
        await rx.wait()
        assert_copied(sender, receiver, [9, 10], [7, 8])


async def test_expect_validates_ids(make_pair):
    async with make_pair() as (_, receiver):
        with pytest.raises(ValueError, match="outside"):
            receiver.expect("v", [NUM_BLOCKS])
        with pytest.raises(ValueError, match="duplicate"):
            receiver.expect("v", [1, 1])
        first, second = receiver.expect("v", [1]), receiver.expect("v", [2])
        # The wire knows a transfer only by an id nobody can guess: 128 random bits per expect().
        assert first.transfer_id != second.transfer_id
        assert all(len(bytes.fromhex(h.transfer_id)) == 16 for h in (first, second))
