"""A real decode worker against a prefill peer that misbehaves on cue.

A transfer given up mid-payload (the prefill worker failed, the client left) may still be writing
into the reserved blocks: the decode worker must free them only once no more bytes can land
(``release_reservation``: abort, ``settled()``, then free).  Where the transport can stop a payload
at once (TCP), settling is immediate and an early free would go unseen; where it cannot (UCX), the
late bytes land for up to ``abort_grace``.  So the first tests run the decode worker's real
``/generate`` in this process (``tests.support.inproc_decode``) with a real ``KVReceiver`` and ``KVSender``
on an in-process transport that behaves like UCX and holds a payload half-written until the test
lets go (``tests.support.held_inproc``): while it is held the blocks must stay reserved, and once it has
ended they must come back.

The rest run the decode worker as a real process (``python -m decode_svc``, TCP transport, real
Redis).  The prefill worker is scripted in the test process, because these faults need exact
timing: it is registered (signed with the stack's cluster secret) as a prefill worker, answers
``/prefill`` the way each test says, and ships canary KV (every value 100.0) with the real
``KVSender`` to the decode worker's registered KV address, through a TCP link that can hold the
bytes mid-payload::

    test --/generate--> decode worker --/prefill--> scripted peer
                        decode worker <==KV== ThrottledLink <== KVSender(canary cache)

A canary that lands in blocks another computation already uses changes its greedy tokens, so
every test ends by comparing tokens with the offline engine's.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import uuid

import pytest

from common.cluster.messages import PrefillRequest, PrefillResult
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.kv.kv_cache import KVCache
from decode_svc.prefill_client import BadPrefillAnswer
from common.cluster.auth import ClusterAuth
from common.cluster.registry import WorkerRegistry
from kvtransfer.config import KVTransferConfig
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import KVSender
from tests.support.cluster import PREWARMED, LocalStack, delete_keys
from tests.support.held_inproc import HeldInProcTransport, PayloadHold
from tests.support.inproc_decode import DecodeHarness
from tests.support.scripted_peer import (
    BLOCK_SIZE, CANARY, MAX_TOKENS, NUM_BLOCKS, WAIT, ScriptedPeer, ThrottledLink, WorkerClient, last_run, ship_held,
)
from tests.support.waiting import until

pytestmark = pytest.mark.slow(seconds=16)  # a long file: scheduled by its length (tests/conftest.py)

PROMPT_TOKENS = 40
KV_TIMEOUT = 10.0        # the decode worker's bound on a remote prefill
WORKER_ARGS = ["--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE), "--max-num-batched-tokens", "16",
               "--kv-timeout", str(KV_TIMEOUT), "--heartbeat-ttl", "2"]


@pytest.fixture(scope="module")
def engine(served_checkpoint):
    """The offline engine: greedy references, and the KV layout the peer must speak."""
    return Engine(EngineConfig(model=str(served_checkpoint), num_blocks=64, block_size=BLOCK_SIZE),
                  load_tokenizer=False)


@pytest.fixture(scope="module")
def decode_worker(served_checkpoint, redis_url, tmp_path_factory):
    stack = LocalStack(str(served_checkpoint), redis_url, key_prefix=f"pdtest-{uuid.uuid4().hex[:12]}",
                       workdir=tmp_path_factory.mktemp("logs"), prefill=0, decode=0, transport="tcp",
                       worker_args=WORKER_ARGS, spawner=PREWARMED, extra_env={"OMP_NUM_THREADS": "1"})
    try:
        stack.start_worker("d0", "decode")
        stack.wait_ready("d0", timeout=WAIT)
        yield stack
    finally:
        stack.stop()
        delete_keys(redis_url, stack.key_prefix)


def greedy(engine: Engine, prompt: list[int]) -> list[int]:
    result = engine.generate([prompt], {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})[0]
    return result.token_ids


def fresh_prompt() -> list[int]:
    """A prompt no earlier test sent (so the worker's prefix cache holds none of it)."""
    return [random.randrange(3, 500) for _ in range(PROMPT_TOKENS)]


# ---- the decode worker's own part: blocks stay reserved while a payload may still land -------------


class HeldPeer:
    """The in-process decode worker (``harness``), its receiver on a UCX-like transport that holds
    the next payload half-written (``hold``), and a scripted prefill peer shipping canary KV."""

    def __init__(self, harness: DecodeHarness, hold: PayloadHold, sender: KVSender, receiver: KVReceiver):
        self.harness, self.hold, self.sender, self.receiver = harness, hold, sender, receiver
        self.shipping: list[asyncio.Future] = []
        self.stopping = asyncio.Event()

    async def ship_held(self, request: PrefillRequest) -> None:
        """Start shipping canary KV for the last run of the reservation; return once the payload is
        held half-written in the blocks."""
        transfer = await self.sender.begin(request.transfer_id, self.receiver.address)
        self.hold.arm()
        src, dst = last_run(request.dst_block_ids)
        self.shipping.append(asyncio.ensure_future(transfer.send_blocks(src, dst)))
        await asyncio.wait_for(self.hold.holding.wait(), WAIT)

    async def reserved_blocks(self, request_id: str) -> int:
        """Blocks the engine still holds for ``request_id``'s reservation (0: freed)."""
        def count(e: Engine) -> int:
            return e.scheduler.kv_manager.num_blocks_of(request_id) if request_id in e.scheduler.reservations else 0
        return await self.harness.engine_state(count)

    def settling(self) -> int:
        return self.harness.worker.metrics.kv_transfers_settling._value.get()


@pytest.fixture
async def held_peer(served_checkpoint, engine, monkeypatch):
    kv = KVTransferConfig(transport="inproc", transfer_timeout=WAIT, abort_grace=WAIT)  # only the test ends a hold
    decode_engine = Engine(EngineConfig(model=str(served_checkpoint), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                        max_num_batched_tokens=16), load_tokenizer=False)
    hold = PayloadHold()
    transport = HeldInProcTransport(hold)
    receiver = KVReceiver(decode_engine.kv_cache, kv, transport=transport)
    await receiver.start()
    canary = KVCache(engine.kv_cache.layout, NUM_BLOCKS)
    canary.buffer.fill_(CANARY)
    sender = KVSender(canary, kv, transport=transport)
    harness = await DecodeHarness(decode_engine, receiver, monkeypatch, kv=kv).start()
    peer = HeldPeer(harness, hold, sender, receiver)
    try:
        yield peer
    finally:
        hold.release()
        peer.stopping.set()
        for task in peer.shipping:
            task.cancel()
        await harness.stop()
        await sender.close()
        await receiver.close()


async def test_failed_prefill_frees_blocks_only_after_the_bytes_in_flight_landed(held_peer, engine):
    """The prefill worker fails while a payload is half-written and cannot be stopped: the blocks
    stay reserved (the local fallback waits) until the payload has ended, then come back; the
    fallback's tokens are the offline engine's."""
    peer, prompt = held_peer, fresh_prompt()

    async def script(request: PrefillRequest):
        await peer.ship_held(request)
        raise BadPrefillAnswer("scripted failure mid-transfer")

    peer.harness.script = script
    stream = peer.harness.generate(prompt, MAX_TOKENS)

    async def settling_or_started():
        if stream.first.is_set():
            return "computing locally while the payload was held"
        return peer.settling() and "settling"

    state = await until(settling_or_started, "the transfer to settle or the fallback to start")
    assert state == "settling", f"the blocks were given up while bytes could still land: {state}"
    assert await peer.reserved_blocks(stream.request_id) == len(prompt) // BLOCK_SIZE, "blocks freed early"
    assert not stream.first.is_set()
    peer.hold.release()  # the rest of the payload lands, then the transfer has settled
    tokens = await stream.tokens()
    assert tokens == greedy(engine, prompt), "KV corrupted"
    assert stream.frames[0].prefill_fallback and peer.harness.aborts == [stream.request_id]
    await peer.harness.idle()
    assert peer.settling() == 0


async def test_client_gone_mid_transfer_keeps_blocks_until_the_transfer_settled(held_peer, engine):
    """The client leaves while a payload is half-written and cannot be stopped: the blocks stay
    reserved until the payload has ended, then come back; the next request is not corrupted."""
    peer = held_peer
    first, second = fresh_prompt(), fresh_prompt()

    async def script(request: PrefillRequest):
        await peer.ship_held(request)
        await peer.stopping.wait()  # a hung peer: only the client's leaving ends the request
        raise BadPrefillAnswer("test over")

    peer.harness.script = script
    gone = peer.harness.generate(first, MAX_TOKENS)
    await asyncio.wait_for(peer.hold.holding.wait(), WAIT)
    gone.task.cancel()  # the client hangs up mid-transfer
    with contextlib.suppress(asyncio.CancelledError):
        await gone.task

    async def settling_or_freed():
        if peer.settling():
            return "settling"
        return not await peer.reserved_blocks(gone.request_id) and "freed"

    state = await until(settling_or_freed, "the abandoned transfer to settle or its blocks to be freed")
    assert state == "settling", f"the blocks were freed while bytes could still land: {state}"
    assert await peer.reserved_blocks(gone.request_id) == len(first) // BLOCK_SIZE
    assert gone.request_id in peer.harness.worker.in_flight  # its cleanup waits for the transfer
    peer.hold.release()
    await peer.harness.idle()  # settled: the blocks came back
    assert peer.settling() == 0 and peer.harness.aborts == [gone.request_id]
    assert await peer.harness.generate(second, MAX_TOKENS, remote=False).tokens() == greedy(engine, second)


@pytest.fixture
async def peer(engine, decode_worker):
    peer = await ScriptedPeer(engine, decode_worker).start()
    try:
        yield peer
    finally:
        await peer.close()


async def test_over_tcp_a_prefill_failing_mid_payload_leaves_the_fallback_uncorrupted(decode_worker, engine, peer):
    """The prefill worker fails while a payload is half-received: the decode worker falls back to
    computing the prompt itself, and none of the late bytes land in the blocks it computes into
    (over TCP the receiver drops them at once: the whole chain, end to end)."""
    prompt = fresh_prompt()
    held: list[ThrottledLink] = []

    async def script(request: PrefillRequest):
        held.append(await ship_held(peer, request))
        return PrefillResult(error="scripted failure mid-transfer"), 502

    peer.script = script
    async with WorkerClient(decode_worker) as worker:
        await worker.idle()
        stream = worker.generate(prompt, peer.worker_id)

        async def settling_or_first_token():
            if stream.first.is_set():
                return "computing locally while the payload was held"
            return (await worker.stats()).get("kv_transfers_settling") and "settling"

        state = await until(settling_or_first_token, "the transfer to settle or the fallback to start")
        # Let the rest of the canary payload go: it must not reach the blocks the local
        # computation of the prompt uses.
        held[0].release()
        tokens = await stream.tokens()
        assert tokens == greedy(engine, prompt), f"KV corrupted ({state})"
        assert stream.frames[0].prefill_fallback
        final = await worker.idle()
        assert final["kv_transfers_settling"] == 0


async def test_over_tcp_a_client_gone_mid_payload_leaves_the_next_request_uncorrupted(decode_worker, engine, peer):
    """The client leaves while a payload is half-received: the next request that gets those
    blocks never sees the late bytes (over TCP the receiver drops them at once)."""
    first, second = fresh_prompt(), fresh_prompt()
    held: list[ThrottledLink] = []

    async def script(request: PrefillRequest):
        held.append(await ship_held(peer, request))
        await peer.hang()
        return PrefillResult(error="test over"), 502

    async def started():
        return bool(held)

    peer.script = script
    async with WorkerClient(decode_worker) as worker:
        await worker.idle()
        gone = worker.generate(first, peer.worker_id)
        await until(started, "the transfer to start")
        gone.task.cancel()  # the client hangs up mid-transfer
        with contextlib.suppress(asyncio.CancelledError):
            await gone.task

        async def settling_or_freed():
            s = await worker.stats()
            if s.get("kv_transfers_settling"):
                return "settling"
            return s["inflight"] == 0 and s["num_free_blocks"] == s["num_blocks"] and "freed"

        state = await until(settling_or_freed, "the abandoned transfer to settle or be freed")
        if state == "settling":
            held[0].release()
            await worker.idle()
            nxt = worker.generate(second, None)
        else:  # the next request takes the blocks while the late bytes are still held back
            nxt = worker.generate(second, None)
            await asyncio.wait_for(nxt.first.wait(), WAIT)
            held[0].release()
        tokens = await nxt.tokens()
        assert tokens == greedy(engine, second), f"KV corrupted (blocks {state})"
        await worker.idle()


async def test_prefill_peer_that_never_answers_is_bounded(decode_worker, engine, peer):
    """The KV arrives but the prefill worker never answers /prefill: the decode worker gives up
    after its remote-prefill bound (--kv-timeout) and computes the prompt itself."""
    prompt = fresh_prompt()

    async def script(request: PrefillRequest):
        kv = await peer.kv_address(request)
        transfer = await peer.sender.begin(request.transfer_id, f"{kv.host}:{kv.port}")
        await transfer.send_blocks(list(range(len(request.dst_block_ids))), request.dst_block_ids)
        await transfer.finish({"first_token": 7})
        await peer.hang()
        return PrefillResult(error="test over"), 502

    peer.script = script
    async with WorkerClient(decode_worker) as worker:
        await worker.idle()
        stream = worker.generate(prompt, peer.worker_id)
        assert await stream.tokens() == greedy(engine, prompt)
        assert stream.frames[0].prefill_fallback
        await worker.idle()


async def test_a_prefill_peer_that_leaves_the_registry_mid_prompt_is_given_up_at_once(decode_worker, engine, peer):
    """The prefill worker stops (SIGSTOP, a frozen host): its socket stays open and it never answers,
    but its registry entry lapses.  Once it has been gone as long as its time to live (one late
    heartbeat is no departure), the decode worker computes the prompt itself -- not after its
    remote-prefill bound (--kv-timeout), which held every request the peer had."""
    prompt = fresh_prompt()
    asked = asyncio.Event()

    async def script(request: PrefillRequest):
        asked.set()
        await peer.hang()
        return PrefillResult(error="test over"), 502

    peer.script = script
    beating = WorkerRegistry(peer.redis, key_prefix=decode_worker.key_prefix, ttl_s=2.0,
                             auth=ClusterAuth(decode_worker.cluster_secret))
    entry = await peer.registry.get(decode_worker.model_name, peer.worker_id)

    async def heartbeat():  # the peer's heartbeat, with a short time to live, until it is stopped
        while not asked.is_set():
            await beating.register(entry)
            await asyncio.sleep(0.2)

    async with WorkerClient(decode_worker) as worker:
        await worker.idle()
        beats = asyncio.ensure_future(heartbeat())
        await beating.register(entry)
        stream = worker.generate(prompt, peer.worker_id)
        await asyncio.wait_for(asked.wait(), WAIT)
        await beats
        await peer.registry.deregister(decode_worker.model_name, peer.worker_id)  # (as its entry lapsing)
        assert await stream.tokens() == greedy(engine, prompt)
        assert stream.frames[0].prefill_fallback
        await worker.idle()
    assert "PrefillPeerLeft" in decode_worker.procs["d0"].log()  # (not the transfer's bound)
