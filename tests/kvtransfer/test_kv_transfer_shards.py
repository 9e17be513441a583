"""KV between workers of different tensor-parallel sizes: each receiving rank gets exactly the kv
heads it owns, from sending ranks that hold them, and no more bytes than that."""
from __future__ import annotations

import asyncio
import contextlib

import msgspec
import pytest
import torch

from common.engine.kv.kv_cache import KVCache, KVLayout
from common.engine.kv.kv_shards import KVShards
from common.engine.parallel.tensor_parallel import TensorParallel
from kvt_support import AUTH, wait_until
from kvtransfer import (
    HandshakeError, KVReceiver, KVSender, KVTransferConfig, PeerLost, TransferTimeout, make_transport,
)
from kvtransfer.config import parse_address
from kvtransfer.handshake import client_handshake
from kvtransfer.messages import Blocks, encode

pytestmark = pytest.mark.asyncio(loop_scope="session")

NUM_BLOCKS = 12
NUM_HEADS = 8  # query heads: a rank's kv heads follow its query heads when they are replicated


def model_layout(kv_heads: int) -> KVLayout:
    return KVLayout(model_id="tiny", dtype="float32", block_size=4, num_layers=2, num_kv_heads=kv_heads, head_dim=8)


def head_ranges(tp: int, kv_heads: int) -> list[tuple[int, int]]:
    return TensorParallel(tp).kv_head_ranges(NUM_HEADS, kv_heads)


def shards_of(full: KVCache, tp: int) -> KVShards:
    """``full``'s heads split as a worker with ``tp`` ranks holds them (a copy per rank)."""
    kv_heads = full.layout.num_kv_heads
    caches = []
    for start, stop in head_ranges(tp, kv_heads):
        cache = KVCache(msgspec.structs.replace(full.layout, num_kv_heads=stop - start), full.num_blocks)
        cache.buffer.copy_(full.buffer[..., start:stop, :])
        caches.append(cache)
    return KVShards(caches, head_ranges(tp, kv_heads), kv_heads)


def empty_shards(kv_heads: int, tp: int) -> KVShards:
    return shards_of(KVCache(model_layout(kv_heads), NUM_BLOCKS), tp)


@contextlib.asynccontextmanager
async def pair(transport: str, sending: KVShards, receiving: KVShards, **config):
    cfg = KVTransferConfig(transport=transport, **config)
    receiver = KVReceiver(receiving, cfg, auth=AUTH)
    await receiver.start()
    sender = KVSender(sending, cfg, auth=AUTH)
    try:
        yield sender, receiver
    finally:
        await sender.close()
        await receiver.close()


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
@pytest.mark.parametrize("kv_heads,p,d", [(4, 2, 1), (4, 1, 2), (4, 2, 2), (4, 4, 2), (4, 1, 4), (1, 2, 1),
                                          (1, 1, 2), (2, 4, 2), (2, 1, 4)])
async def test_each_receiving_rank_gets_exactly_its_heads(transport, kv_heads, p, d):
    full = KVCache(model_layout(kv_heads), NUM_BLOCKS)
    full.buffer.copy_(torch.randn(full.buffer.shape, generator=torch.Generator().manual_seed(p * 10 + d)))
    src, dst = [1, 2, 3, 7, 9], [4, 5, 0, 11, 10]
    receiving = empty_shards(kv_heads, d)
    async with pair(transport, shards_of(full, p), receiving) as (sender, receiver):
        rx = receiver.expect("r", dst)
        tx = await sender.begin(rx.transfer_id, receiver.address)
        await tx.send_blocks(src[:2], dst[:2])
        await tx.send_blocks(src[2:], dst[2:])
        await tx.finish({"first": 3})
        result = await rx.wait()
    for rank, (start, stop) in enumerate(receiving.head_ranges):
        got = receiving.caches[rank].buffer
        assert torch.equal(got[dst], full.buffer[src][..., start:stop, :]), f"rank {rank} holds the wrong heads"
        untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
        assert not got[untouched].any(), "bytes landed outside the reservation"
    owned = sum(stop - start for start, stop in receiving.head_ranges) * receiving.head_nbytes(0) * len(dst)
    assert result.nbytes == tx.nbytes == owned, "shipped more (or less) than the receiving ranks own"
    assert result.metadata == {"first": 3}


async def test_a_sender_for_another_model_shape_is_refused_with_the_reason():
    async with pair("tcp", empty_shards(2, 2), empty_shards(4, 2)) as (sender, receiver):
        with pytest.raises(HandshakeError, match="num_kv_heads: 4 != 2"):
            await sender.begin("x", receiver.address)


async def test_a_sender_whose_ranks_miss_heads_is_refused_with_the_reason():
    full = KVCache(model_layout(4), NUM_BLOCKS)
    with pytest.raises(ValueError, match=r"no rank holds kv heads \[2, 3\]"):
        KVShards(shards_of(full, 2).caches, [(0, 2), (0, 2)], 4)  # a worker cannot hold such shards ...
    async with pair("tcp", shards_of(full, 1), empty_shards(4, 2)) as (_sender, receiver):
        net = make_transport("tcp")
        channel = await net.connect(*parse_address(receiver.address), timeout=5.0)
        try:  # ... nor announce them
            with pytest.raises(HandshakeError, match=r"2 tensor-parallel ranks .* no rank holds kv heads \[2, 3\]"):
                await client_handshake(channel, _LyingShards(full), False, 5.0, AUTH)
        finally:
            channel.close()
            net.close()


class _LyingShards:
    """A peer announcing ranks that hold heads 0-1 only, of a 4-head model."""

    def __init__(self, full: KVCache):
        self.layout = full.layout
        self.num_ranks = 2
        self.head_ranges = [(0, 2), (0, 2)]


async def test_a_frame_for_heads_the_rank_does_not_hold_ends_the_connection():
    receiving = empty_shards(4, 2)
    async with pair("tcp", empty_shards(4, 1), receiving, transfer_timeout=1.0) as (sender, receiver):
        rx = receiver.expect("r", [1])
        tx = await sender.begin(rx.transfer_id, receiver.address)
        bad = torch.ones(2 * receiving.head_nbytes(1), dtype=torch.uint8)  # heads 0-1, claimed for rank 1 (2-3)
        await tx._conn.channel.send(encode(Blocks(rx.transfer_id, 1, 1, bad.numel(), None, 1, (0, 2))), bad)
        await wait_until(lambda: tx.done())
        assert isinstance(tx.error, PeerLost), "the receiver dropped the connection that sent the frame"
        with pytest.raises(TransferTimeout):  # a header that cannot be trusted binds nothing: the deadline ends it
            await rx.wait()
        assert not receiving.caches[1].buffer.any() and not receiving.caches[0].buffer.any()


async def test_a_piece_copied_out_of_a_share_is_sent_only_once_its_copy_completed(monkeypatch):
    """One sending rank, two receiving ones: each piece is a copy of half the share's heads, which
    on CUDA is only queued on the event loop's stream -- and UCX reads device memory on streams of
    its own.  So the copy's own fence is waited on before the piece goes out (a stand-in fence here,
    completed by the test, plays the device)."""
    from kvtransfer import sender as sender_module
    from test_kv_transfer_ordering import BOUND, StandInFence

    fences = []

    def record_fence(device):
        fences.append(StandInFence())
        return fences[-1]

    monkeypatch.setattr(sender_module, "record_fence", record_fence)
    full = KVCache(model_layout(2), NUM_BLOCKS)
    full.buffer.copy_(torch.randn(full.buffer.shape, generator=torch.Generator().manual_seed(5)))
    receiving = empty_shards(2, 2)
    async with pair("tcp", shards_of(full, 1), receiving) as (sender, receiver):
        rx = receiver.expect("r", [4])
        tx = await sender.begin(rx.transfer_id, receiver.address)
        send = asyncio.ensure_future(tx.send_blocks([1], [4]))
        for rank in range(2):  # a piece for each receiving rank, each sent once its copy completed
            await wait_until(lambda: len(fences) > rank and fences[rank].waited_on.is_set(), what="the piece's fence")
            await asyncio.sleep(0.1)
            assert not send.done() and not receiving.caches[rank].buffer.any(), "sent before its copy completed"
            fences[rank].completed.set()
        await asyncio.wait_for(send, BOUND)
        await tx.finish()
        await rx.wait()
    assert len(fences) == 2
    for rank, (start, stop) in enumerate(receiving.head_ranges):
        assert torch.equal(receiving.caches[rank].buffer[4], full.buffer[1][..., start:stop, :])
