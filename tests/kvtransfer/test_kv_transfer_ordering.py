"""Ordering of KV shipping against the engine's device writes, and the TCP staging path, on CPU.

On CUDA a sender must not read blocks before the fence recorded after the step that wrote them
has completed (``kvtransfer.ordering``); here a stand-in fence, completed by the test, plays the
device. The TCP transport's staging path (a reused host buffer, device<->host copies in a worker
thread, pieces of at most ``STAGING_BYTES``) is exercised on CPU tensors by routing them through
it (``needs_staging``), with a small staging size.
"""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from common.engine.kv.kv_cache import KVCache
from kvt_support import AUTH, LAYOUT, NUM_BLOCKS, random_cache, wait_until
from kvtransfer import KVReceiver, KVSender, KVTransferConfig, TransferAborted
from kvtransfer import transport_tcp
from kvtransfer.messages import Blocks, encode
from kvtransfer.ordering import record_fence, wait_for_fence
from kvtransfer.regions import run_bytes

pytestmark = pytest.mark.asyncio(loop_scope="session")

BOUND = 60.0


class StandInFence:
    """Completes when the test says so (the device finishing the step's writes)."""

    def __init__(self) -> None:
        self.completed = threading.Event()
        self.waited_on = threading.Event()

    def query(self) -> bool:
        return self.completed.is_set()

    def synchronize(self) -> None:
        self.waited_on.set()
        assert self.completed.wait(BOUND), "fence never completed"


async def test_cpu_needs_no_fence():
    assert record_fence(torch.device("cpu")) is None
    await wait_for_fence(None)


async def test_blocks_are_read_only_after_their_fence_and_the_loop_keeps_going(make_pair):
    async with make_pair() as (sender, receiver):
        rx_a = receiver.expect("fenced", [1, 2])
        rx_b = receiver.expect("other", [3])
        tx_a = await sender.begin(rx_a.transfer_id, receiver.address)
        tx_b = await sender.begin(rx_b.transfer_id, receiver.address)
        fence = StandInFence()
        send_a = asyncio.create_task(tx_a.send_blocks([5, 6], [1, 2], fence))
        await wait_until(fence.waited_on.is_set)

        # While A waits for its fence, the loop and the shared connection serve B.
        await tx_b.send_blocks([7], [3])
        await asyncio.wait_for(tx_b.finish(), BOUND)
        await asyncio.wait_for(rx_b.wait(), BOUND)
        assert not send_a.done() and not receiver.cache.buffer[[1, 2]].any(), "read before the fence"

        # The "device" finishes writing the blocks; only then are they read.
        sender.cache.buffer[[5, 6]] = random_cache(11).buffer[[5, 6]]
        fence.completed.set()
        await asyncio.wait_for(send_a, BOUND)
        await asyncio.wait_for(tx_a.finish(), BOUND)
        await asyncio.wait_for(rx_a.wait(), BOUND)
        assert torch.equal(receiver.cache.buffer[[1, 2]], random_cache(11).buffer[[5, 6]])


async def test_cancelled_while_waiting_for_the_fence_aborts_and_sends_nothing(make_pair):
    async with make_pair() as (sender, receiver):
        rx = receiver.expect("cancelled", [4])
        tx = await sender.begin(rx.transfer_id, receiver.address)
        fence = StandInFence()
        send = asyncio.create_task(tx.send_blocks([8], [4], fence))
        await wait_until(fence.waited_on.is_set)
        send.cancel()
        with pytest.raises(asyncio.CancelledError):
            await send
        with pytest.raises(TransferAborted, match="sender cancelled"):
            await asyncio.wait_for(rx.wait(), BOUND)
        fence.completed.set()
        assert not receiver.cache.buffer[4].any()


# -- TCP staging (device payloads) on CPU -----------------------------------------------------


@pytest.fixture
def staged(monkeypatch):
    """Route chosen CPU tensors through the staging path with a 2-block buffer; record the
    threads the copies ran on."""
    copies: list[int] = []
    real_copy = transport_tcp._copy

    def copy(dst, src):
        copies.append(threading.get_ident())
        real_copy(dst, src)

    monkeypatch.setattr(transport_tcp, "STAGING_BYTES", 2 * LAYOUT.block_nbytes)
    monkeypatch.setattr(transport_tcp, "_copy", copy)

    def route(predicate) -> list[int]:
        monkeypatch.setattr(transport_tcp, "needs_staging", predicate)
        return copies

    return route


async def pair(config=None):
    cfg = config or KVTransferConfig(transport="tcp")
    receiver = KVReceiver(KVCache(LAYOUT, NUM_BLOCKS), cfg, auth=AUTH)
    await receiver.start()
    return KVSender(random_cache(1), cfg, auth=AUTH), receiver


async def test_staged_send_and_receive_in_pieces_off_the_loop(staged):
    copies = staged(lambda tensor: True)  # both ends: "device" caches
    sender, receiver = await pair()
    try:
        src, dst = [10, 11, 12, 13, 14], [20, 21, 22, 23, 24]  # one run, more than the staging buffer
        rx = receiver.expect("staged", dst)
        tx = await sender.begin(rx.transfer_id, receiver.address)
        await tx.send_blocks(src, dst)
        await asyncio.wait_for(tx.finish(), BOUND)
        await asyncio.wait_for(rx.wait(), BOUND)
        assert torch.equal(receiver.cache.buffer[dst], sender.cache.buffer[src])
        assert len(copies) == 6  # 3 frames of <= 2 blocks, each staged once per side
        assert threading.get_ident() not in copies, "a device<->host copy ran on the event loop"
    finally:
        await sender.close()
        await receiver.close()


async def send_one_frame(tx, cache: KVCache, src: int, dst: int, count: int) -> None:
    """One Blocks frame of ``count`` blocks, whatever the channel's payload limit (a peer's choice)."""
    region = run_bytes(cache, src, count)
    await tx._conn.channel.send(encode(Blocks(tx.transfer_id, dst, count, region.numel())), region)


async def test_staged_receive_of_a_frame_larger_than_the_buffer(staged):
    sender, receiver = await pair()
    ours = receiver.cache.buffer.untyped_storage().data_ptr()
    copies = staged(lambda tensor: tensor.untyped_storage().data_ptr() == ours)  # only the receiver stages
    try:
        rx = receiver.expect("big-frame", [1, 2, 3, 4, 5])
        tx = await sender.begin(rx.transfer_id, receiver.address)
        await send_one_frame(tx, sender.cache, 6, 1, 5)
        await asyncio.wait_for(tx.finish(), BOUND)
        await asyncio.wait_for(rx.wait(), BOUND)
        assert torch.equal(receiver.cache.buffer[1:6], sender.cache.buffer[6:11])
        assert len(copies) == 3  # pieces of 2, 2 and 1 blocks
    finally:
        await sender.close()
        await receiver.close()


async def test_abort_during_a_staged_copy_waits_for_it_then_drops_the_rest(staged, monkeypatch):
    """A piece is being copied into the blocks when the transfer is aborted: the handle settles
    only once that copy has ended, nothing after it lands, and the connection goes on."""
    sender, receiver = await pair()
    ours = receiver.cache.buffer.untyped_storage().data_ptr()
    staged(lambda tensor: tensor.untyped_storage().data_ptr() == ours)
    copying, release = threading.Event(), threading.Event()
    real_copy = transport_tcp._copy

    def slow_first_copy(dst, src):
        if not copying.is_set():
            copying.set()
            assert release.wait(BOUND)
        real_copy(dst, src)

    monkeypatch.setattr(transport_tcp, "_copy", slow_first_copy)
    try:
        rx = receiver.expect("diverted", [1, 2, 3, 4, 5])
        tx = await sender.begin(rx.transfer_id, receiver.address)
        await send_one_frame(tx, sender.cache, 6, 1, 5)
        await wait_until(copying.is_set)
        receiver.abort(rx.transfer_id, "client left")
        assert not rx.done(), "settled while a copy was still writing the blocks"
        release.set()
        await asyncio.wait_for(rx.settled(), BOUND)
        with pytest.raises(TransferAborted, match="client left"):
            await rx.wait()
        assert torch.equal(receiver.cache.buffer[1:3], sender.cache.buffer[6:8])  # the piece in flight
        assert not receiver.cache.buffer[3:6].any(), "bytes landed after the abort"

        rx_next = receiver.expect("next", [9, 10])
        tx_next = await sender.begin(rx_next.transfer_id, receiver.address)
        await tx_next.send_blocks([12, 13], [9, 10])
        await asyncio.wait_for(tx_next.finish(), BOUND)
        await asyncio.wait_for(rx_next.wait(), BOUND)
        assert torch.equal(receiver.cache.buffer[9:11], sender.cache.buffer[12:14]), "framing lost"
    finally:
        release.set()
        await sender.close()
        await receiver.close()


async def test_a_staged_block_larger_than_the_buffer_is_sent_whole_and_received_in_pieces(staged, monkeypatch):
    """One block is more than STAGING_BYTES (a large model's at a large block size): the sender
    stages it whole (it failed an assertion, and every prefill of such a worker failed with it)."""
    copies = staged(lambda tensor: True)
    monkeypatch.setattr(transport_tcp, "STAGING_BYTES", LAYOUT.block_nbytes // 2)  # (over the fixture's)
    sender, receiver = await pair()
    try:
        rx = receiver.expect("huge-block", [3, 4])
        tx = await sender.begin(rx.transfer_id, receiver.address)
        await tx.send_blocks([7, 8], [3, 4])
        await asyncio.wait_for(tx.finish(), BOUND)
        await asyncio.wait_for(rx.wait(), BOUND)
        assert torch.equal(receiver.cache.buffer[[3, 4]], sender.cache.buffer[[7, 8]])
        assert len(copies) == 2 + 4  # a block a frame staged whole; each received in two halves
    finally:
        await sender.close()
        await receiver.close()
