"""Sender and receiver in separate processes (tcp and ucx), including killing either one."""
from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest
import torch

from common.engine.kv.block_pool import BlockPool
from common.engine.kv.kv_cache import KVCache
from kvt_support import AUTH, LAYOUT, NUM_BLOCKS, random_cache
from kvtransfer import KVReceiver, KVSender, KVTransferConfig, PeerLost, TransferError
from tests.support.spawned import SpawnedProcess

pytestmark = [pytest.mark.slow(seconds=21),  # a long file: scheduled by its length (tests/conftest.py)
              pytest.mark.asyncio(loop_scope="session"), pytest.mark.parametrize("transport", ["tcp", "ucx"])]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kv_peer.py")


class Peer:
    """A kv_peer.py subprocess whose JSON event lines we can await one by one (started without
    ``fork()``: see tests/support/spawned.py)."""

    def __init__(self, proc: SpawnedProcess):
        self.proc = proc

    @classmethod
    async def start(cls, *args: str) -> "Peer":
        return cls(await SpawnedProcess.start([sys.executable, PEER, *args], cwd=REPO))

    async def event(self) -> dict:
        line = await asyncio.wait_for(self.proc.stdout.readline(), 120)
        assert line, f"peer exited with {await self.proc.wait(120)} before reporting"
        return json.loads(line)

    async def kill(self) -> None:
        await self.proc.kill()


async def start_receiver(transport: str, timeout: float = 120.0) -> KVReceiver:
    cfg = KVTransferConfig(transport=transport, transfer_timeout=timeout)
    receiver = KVReceiver(KVCache(LAYOUT, NUM_BLOCKS), cfg, auth=AUTH)
    await receiver.start()
    return receiver


async def test_round_trip_between_processes(transport):
    receiver = await start_receiver(transport)
    src, dst = [1, 2, 3, 8, 9, 30], [4, 5, 12, 13, 14, 2]
    rx = receiver.expect("round-trip", dst)
    peer = await Peer.start("send", "--transport", transport, "--address", receiver.address,
                            "--transfer-id", rx.transfer_id, "--src", ",".join(map(str, src)), "--dst", ",".join(map(str, dst)))
    try:
        result = await rx.wait()
        assert result.metadata == {"first_token": [123]}
        assert torch.equal(receiver.cache.buffer[dst], random_cache(7).buffer[src])
        assert [(await peer.event())["event"] for _ in range(4)] == ["chunk", "chunk", "chunk", "acked"]
    finally:
        await peer.kill()
        await receiver.close()


async def test_sender_killed_mid_transfer(transport):
    """The receiver reports the failure (peer lost, or at the latest its deadline) and the pool holds."""
    pool = BlockPool(NUM_BLOCKS)
    receiver = await start_receiver(transport)
    blocks = pool.allocate(6)
    dst = [b.block_id for b in blocks]
    rx = receiver.expect("killed-sender", dst)
    peer = await Peer.start("send", "--transport", transport, "--address", receiver.address,
                            "--transfer-id", rx.transfer_id, "--src", "1,2,3,4,5,6", "--dst", ",".join(map(str, dst)), "--hang-after", "1")
    try:
        assert (await peer.event())["event"] == "chunk"
        await peer.kill()
        with pytest.raises(TransferError) as failure:
            await rx.wait()
        assert isinstance(failure.value, PeerLost), f"expected peer loss to be noticed, got {failure.value!r}"
        pool.free(blocks)
        pool.check_integrity()
        assert pool.num_free_blocks == NUM_BLOCKS
        assert receiver.num_pending == 0
        # The receiver keeps working for other senders.
        rx2 = receiver.expect("after", [0])
        sender = KVSender(random_cache(1), receiver.config, auth=AUTH)
        tx = await sender.begin(rx2.transfer_id, receiver.address)
        await tx.send_blocks([5], [0])
        await tx.finish()
        await rx2.wait()
        await sender.close()
    finally:
        await peer.kill()
        await receiver.close()


async def test_receiver_killed_sender_frees(transport):
    peer = await Peer.start("recv", "--transport", transport, "--dst", "1,2,3,4")
    sender = KVSender(random_cache(1), KVTransferConfig(transport=transport, lease_timeout=120.0), auth=AUTH)
    try:
        listening = await peer.event()
        tid = listening["transfer_id"]
        tx = await sender.begin(tid, listening["address"])
        await tx.send_blocks([1, 2], [1, 2])
        await peer.kill()
        with pytest.raises(TransferError) as failure:
            await tx.send_blocks([3, 4], [3, 4])
            await tx.finish()
        assert isinstance(failure.value, PeerLost), f"expected peer loss, got {failure.value!r}"
        assert tx.done() and sender.get(tid) is None
    finally:
        await peer.kill()
        await sender.close()
