"""KV connections are authenticated both ways before any block moves; transfer ids are bound to them.

Whoever can reach a KV port must not be able to write into reserved blocks (forged KV would be
served to every request sharing the prefix), and a sender must not ship KV to a listener that
cannot prove it belongs to the deployment. Each refusal leaves the receiver exactly as it was.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from common.cluster.auth import ClusterAuth
from common.engine.kv.kv_cache import KVCache
from kvt_support import AUTH, LAYOUT, NUM_BLOCKS, random_cache
from kvtransfer import (
    ConnectionLost, HandshakeError, KVReceiver, KVSender, KVTransferConfig, TransferAborted, make_transport,
)
from kvtransfer.config import parse_address
from kvtransfer.messages import Blocks, Challenge, Hello, Proof, Reject, decode, encode

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.parametrize("transport", ["tcp", "ucx"])]

BOUND = 60.0
CREDENTIALS = {"no secret": ClusterAuth.disabled(), "wrong secret": ClusterAuth("not-the-cluster-secret-at-all")}


async def start_receiver(transport: str, auth: ClusterAuth = AUTH) -> KVReceiver:
    receiver = KVReceiver(KVCache(LAYOUT, NUM_BLOCKS), KVTransferConfig(transport=transport), auth=auth)
    await receiver.start()
    return receiver


async def complete(receiver: KVReceiver, rx, src: list[int], dst: list[int]) -> None:
    """A genuine sender fills ``rx``: the refusals before it left the receiver able to."""
    sender = KVSender(random_cache(1), receiver.config, auth=AUTH)
    try:
        tx = await sender.begin(rx.transfer_id, receiver.address)
        await tx.send_blocks(src, dst)
        await asyncio.wait_for(tx.finish(), BOUND)
        await asyncio.wait_for(rx.wait(), BOUND)
        assert torch.equal(receiver.cache.buffer[dst], sender.cache.buffer[src])
    finally:
        await sender.close()


@pytest.mark.parametrize("credentials", list(CREDENTIALS))
async def test_sender_without_the_secret_is_refused_and_nothing_changes(transport, credentials):
    receiver = await start_receiver(transport)
    intruder = KVSender(random_cache(9), receiver.config, auth=CREDENTIALS[credentials])
    try:
        rx = receiver.expect("victim", [1, 2])
        # Without a secret the receiver refuses it; with another secret it already refuses the
        # receiver's proof. Either way no frame but the handshake's reaches the receiver.
        with pytest.raises(HandshakeError, match="authentication failed|receiver could not prove"):
            await intruder.begin(rx.transfer_id, receiver.address)
        assert rx.active and rx._conn is None and receiver.num_pending == 1
        assert not receiver.cache.buffer.any(), "bytes landed from an unauthenticated sender"
        await complete(receiver, rx, [3, 4], [1, 2])
    finally:
        await intruder.close()
        await receiver.close()


@pytest.mark.parametrize("credentials", list(CREDENTIALS))
async def test_sender_ships_nothing_to_a_receiver_without_the_secret(transport, credentials):
    impostor = await start_receiver(transport, CREDENTIALS[credentials])
    sender = KVSender(random_cache(1), impostor.config, auth=AUTH)
    try:
        rx = impostor.expect("bait", [1])
        with pytest.raises(HandshakeError, match="receiver could not prove it holds the cluster secret"):
            await sender.begin(rx.transfer_id, impostor.address)
        assert not impostor.cache.buffer.any()
        assert rx.active and rx._conn is None
    finally:
        await sender.close()
        await impostor.close()


async def test_no_frame_is_taken_before_the_proof_and_a_wrong_proof_learns_nothing(transport):
    """A raw peer: Blocks in place of the proof ends the connection unanswered; a wrong proof gets
    a Reject and nothing else (under UCX: not the receiver's UCX address either)."""
    receiver = await start_receiver(transport)
    net = make_transport(transport)
    rx = receiver.expect("target", [5])
    block = random_cache(2).buffer[0].reshape(-1).view(torch.uint8)
    try:
        for step in ("blocks instead of proof", "wrong proof"):
            channel = await net.connect(*parse_address(receiver.address), 5.0)
            try:
                await channel.send(encode(Hello(layout=LAYOUT, nonce=bytes(32))))
                assert isinstance(decode(await asyncio.wait_for(channel.recv_header(), BOUND)), Challenge)
                if step == "blocks instead of proof":
                    await channel.send(encode(Blocks(rx.transfer_id, 5, 1, block.numel())))
                else:
                    await channel.send(encode(Proof(proof=bytes(32))))
                    reply = decode(await asyncio.wait_for(channel.recv_header(), BOUND))
                    assert isinstance(reply, Reject) and reply.reason == "authentication failed"
                with pytest.raises(ConnectionLost):
                    await asyncio.wait_for(channel.recv_header(), BOUND)  # closed, nothing more said
            finally:
                channel.close()
        assert rx.active and rx._conn is None and receiver.num_pending == 1
        assert not receiver.cache.buffer.any()
        await complete(receiver, rx, [6], [5])
    finally:
        net.close()
        await receiver.close()


async def test_a_transfer_id_is_bound_to_the_connection_that_first_used_it(transport):
    """Another authenticated connection presenting the same id is refused and its bytes dropped."""
    receiver = await start_receiver(transport)
    owner = KVSender(random_cache(1), receiver.config, auth=AUTH)
    other = KVSender(random_cache(2), receiver.config, auth=AUTH)
    try:
        rx = receiver.expect("bound", [1, 2])
        tx = await owner.begin(rx.transfer_id, receiver.address)
        await tx.send_blocks([3], [1])
        hijack = await other.begin(rx.transfer_id, receiver.address)
        assert hijack._conn.channel is not tx._conn.channel
        await hijack.send_blocks([4], [2])
        with pytest.raises(TransferAborted, match="bound to another sender connection"):
            await asyncio.wait_for(hijack.finish(), BOUND)
        assert rx.active and not receiver.cache.buffer[2].any(), "the second connection wrote into the transfer"
        await tx.send_blocks([4], [2])
        await asyncio.wait_for(tx.finish(), BOUND)
        await asyncio.wait_for(rx.wait(), BOUND)
        assert torch.equal(receiver.cache.buffer[[1, 2]], owner.cache.buffer[[3, 4]])
    finally:
        await owner.close()
        await other.close()
        await receiver.close()


async def test_every_kv_listener_binds_only_the_configured_host(transport):
    """The KV port, and under UCX also UCX's own TCP sockets, listen on loopback only when the KV
    host is loopback (UCX's default would listen on every interface of the machine)."""
    import psutil

    def listening() -> set[tuple[str, int]]:
        return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")
                if c.status == psutil.CONN_LISTEN}

    before = listening()
    receiver = await start_receiver(transport)
    sender = KVSender(random_cache(1), receiver.config, auth=AUTH)
    try:
        rx = receiver.expect("bind", [1])
        tx = await sender.begin(rx.transfer_id, receiver.address)  # the sender's UCX worker too
        await tx.send_blocks([2], [1])
        await asyncio.wait_for(tx.finish(), BOUND)
        opened = listening() - before
        assert opened and {ip for ip, _ in opened} == {"127.0.0.1"}, opened
    finally:
        await sender.close()
        await receiver.close()
