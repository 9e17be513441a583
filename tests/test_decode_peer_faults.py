"""A real decode worker against a prefill peer that misbehaves on cue.

A transfer given up mid-payload (the prefill worker failed, the client left) may still be writing
into the reserved blocks: the decode worker must free them only once no more bytes can land
(``release_reservation``: abort, ``settled()``, then free).  Where the transport can stop a payload
at once (TCP), settling is immediate and an early free would go unseen; where it cannot (UCX), the
late bytes land for up to ``abort_grace``.  So the first tests run the decode worker's real
``/generate`` in this process (``tests.inproc_decode``) with a real ``KVReceiver`` and ``KVSender``
on an in-process transport that behaves like UCX and holds a payload half-written until the test
lets go (``tests.held_inproc``): while it is held the blocks must stay reserved, and once it has
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

import aiohttp
import pytest
from aiohttp import web

from common.cluster.auth import ClusterAuth
from common.cluster.messages import (
    AbortRequest, GenerateRequest, PrefillRequest, PrefillResult, TokenFrame, decode, encode, read_frame,
)
from common.cluster.redis_util import connect
from common.cluster.registry import Capacity, KVAddress, WorkerInfo, WorkerRegistry
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.kv_cache import KVCache
from common.engine.sampling_params import SamplingParams
from decode_svc.prefill_client import BadPrefillAnswer
from kvtransfer.config import KVTransferConfig
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import KVSender
from tests.cluster import LocalStack, delete_keys
from tests.held_inproc import HeldInProcTransport, PayloadHold
from tests.inproc_decode import DecodeHarness
from tests.waiting import until

BLOCK_SIZE = 4
NUM_BLOCKS = 16          # a prompt of 10 blocks plus its output needs the whole pool
PROMPT_TOKENS = 40
MAX_TOKENS = 24
KV_TIMEOUT = 10.0        # the decode worker's bound on a remote prefill
WORKER_ARGS = ["--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE), "--max-num-batched-tokens", "16",
               "--kv-timeout", str(KV_TIMEOUT), "--heartbeat-ttl", "2"]
CANARY = 100.0
WAIT = 120.0             # generous bound for anything the test waits on


@pytest.fixture(scope="module")
def engine(served_checkpoint):
    """The offline engine: greedy references, and the KV layout the peer must speak."""
    return Engine(EngineConfig(model=str(served_checkpoint), num_blocks=64, block_size=BLOCK_SIZE),
                  load_tokenizer=False)


@pytest.fixture(scope="module")
def decode_worker(served_checkpoint, redis_url, tmp_path_factory):
    stack = LocalStack(str(served_checkpoint), redis_url, key_prefix=f"pdtest-{uuid.uuid4().hex[:12]}",
                       workdir=tmp_path_factory.mktemp("logs"), prefill=0, decode=0, transport="tcp",
                       worker_args=WORKER_ARGS, extra_env={"OMP_NUM_THREADS": "1"})
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


class ThrottledLink:
    """A TCP relay in front of the worker's KV port that can hold the sender's bytes mid-frame.

    ``hold_after(n)``: forward at most ``n`` more bytes towards the receiver, then hold the rest
    (``held`` is set) until ``release()``.  Replies (Welcome, Ack, Abort) always pass."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.held = asyncio.Event()
        self._quota: int | None = None
        self._released = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def hold_after(self, nbytes: int) -> None:
        self._quota = nbytes
        self._released.clear()

    def release(self) -> None:
        self._quota = None
        self._released.set()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        tasks = [asyncio.ensure_future(self._pump(reader, up_writer, throttled=True)),
                 asyncio.ensure_future(self._pump(up_reader, writer, throttled=False))]
        self._tasks.update(tasks)
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        writer.close()
        up_writer.close()

    async def _pump(self, reader, writer, throttled: bool) -> None:
        while data := await reader.read(1 << 16):
            while data:
                if not throttled or self._quota is None:
                    chunk = data
                elif self._quota > 0:
                    chunk = data[: self._quota]
                    self._quota -= len(chunk)
                else:
                    await writer.drain()
                    self.held.set()
                    await self._released.wait()
                    continue
                writer.write(chunk)
                data = data[len(chunk):]
            await writer.drain()

    async def close(self) -> None:
        self.release()
        for task in self._tasks:
            task.cancel()
        if self._server is not None:
            self._server.close()


class ScriptedPeer:
    """A stand-in prefill worker: ``/prefill`` runs ``self.script(request)``; ``/abort`` is noted."""

    def __init__(self, engine: Engine, stack: LocalStack):
        self.stack = stack
        self.worker_id = f"scripted-{uuid.uuid4().hex[:8]}"
        self.redis = connect(stack.redis_url)
        self.registry = WorkerRegistry(self.redis, key_prefix=stack.key_prefix, ttl_s=600,
                                       auth=ClusterAuth(stack.cluster_secret))
        layout = engine.kv_cache.layout
        self.cache = KVCache(layout, NUM_BLOCKS)
        self.cache.buffer.fill_(CANARY)
        self.sender = KVSender(self.cache, KVTransferConfig(transport="tcp"), auth=ClusterAuth(stack.cluster_secret))
        self.script = None
        self.aborted: set[str] = set()
        self.stopping = asyncio.Event()
        self.links: list[ThrottledLink] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> "ScriptedPeer":
        app = web.Application()
        app.router.add_post("/prefill", self._prefill)
        app.router.add_post("/abort", self._abort)
        self._runner = web.AppRunner(app, shutdown_timeout=1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        await self.registry.register(WorkerInfo(
            worker_id=self.worker_id, role="prefill", model=self.stack.model_name, http_address=self.url,
            kv_address=KVAddress("tcp", "127.0.0.1", 1), state="active",
            capacity=Capacity(num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=8)))
        return self

    async def kv_address(self, request: PrefillRequest) -> KVAddress:
        """Where the calling decode worker receives KV: its registry entry, as a real prefill worker does."""
        entry = await self.registry.get(self.stack.model_name, request.decode_worker_id)
        return entry.kv_address

    async def link(self, request: PrefillRequest) -> tuple[ThrottledLink, str]:
        kv = await self.kv_address(request)
        link = ThrottledLink((kv.host, kv.port))
        self.links.append(link)
        return link, await link.start()

    async def _prefill(self, request: web.Request) -> web.Response:
        body = decode(await request.read(), PrefillRequest)
        result, status = await self.script(body)
        return web.Response(body=encode(result), status=status)

    async def _abort(self, request: web.Request) -> web.Response:
        self.aborted.add(decode(await request.read(), AbortRequest).request_id)
        return web.json_response({"aborted": True})

    async def hang(self) -> None:
        """What a hung peer does: nothing, until the test ends."""
        await self.stopping.wait()

    async def close(self) -> None:
        self.stopping.set()
        for link in self.links:
            await link.close()
        await self.sender.close()
        await self._runner.cleanup()
        await self.registry.deregister(self.stack.model_name, self.worker_id)
        await self.redis.aclose()


def last_run(dst_block_ids: list[int]) -> tuple[list[int], list[int]]:
    """The last run of consecutive destination ids, with as many consecutive canary sources.

    An abandoned reservation is freed tail first, so its last blocks are the first to be handed
    out again: a late write there is what would corrupt the next user."""
    start = len(dst_block_ids) - 1
    while start > 0 and dst_block_ids[start - 1] == dst_block_ids[start] - 1:
        start -= 1
    dst = dst_block_ids[start:]
    return list(range(len(dst))), dst


async def ship_held(peer: ScriptedPeer, request: PrefillRequest) -> ThrottledLink:
    """Start shipping canary KV for the last run of the reservation and hold it mid-payload
    (the receiver is writing into the blocks when the bytes stop)."""
    link, address = await peer.link(request)
    transfer = await peer.sender.begin(request.kv_transfer_id, address)
    link.hold_after(512)  # past the frame header, well inside the first block's payload
    src, dst = last_run(request.dst_block_ids)
    asyncio.ensure_future(transfer.send_blocks(src, dst))
    await asyncio.wait_for(link.held.wait(), WAIT)
    return link


class Stream:
    """One /generate call on the decode worker, read frame by frame in the background."""

    def __init__(self, client: "WorkerClient", prompt: list[int], prefill_worker_id: str | None):
        self.frames: list[TokenFrame] = []
        self.first = asyncio.Event()
        body = GenerateRequest(request_id=f"t-{uuid.uuid4().hex[:8]}", prompt_token_ids=prompt,
                               sampling_params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                               prefill_worker_id=prefill_worker_id)
        self.task = asyncio.ensure_future(self._read(client, encode(body)))

    async def _read(self, client: "WorkerClient", data: bytes) -> list[TokenFrame]:
        async with client.post("/generate", data) as resp:
            while (frame := await read_frame(resp.content, TokenFrame)) is not None:
                self.frames.append(frame)
                self.first.set()
                if frame.finished or frame.error:
                    break
        return self.frames

    async def tokens(self) -> list[int]:
        frames = await asyncio.wait_for(self.task, WAIT)
        errors = [f.error for f in frames if f.error]
        assert not errors, errors
        return [t for f in frames for t in f.token_ids]


class WorkerClient:
    """Calls the decode worker's internal API the way its peers do (signed with the cluster secret)."""

    def __init__(self, stack: LocalStack, name: str = "d0"):
        self.audience = stack.worker_audience(name)  # its id and run: what every call is signed for
        self.url = stack.worker_url(name)
        self.auth = ClusterAuth(stack.cluster_secret)
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "WorkerClient":
        self.session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()

    def post(self, path: str, data: bytes):
        return self.session.post(self.url + path, data=data,
                                 headers=self.auth.sign_request("POST", path, data, audience=self.audience))

    def generate(self, prompt: list[int], prefill_worker_id: str | None) -> Stream:
        return Stream(self, prompt, prefill_worker_id)

    async def stats(self) -> dict:
        async with self.session.get(self.url + "/stats",
                                    headers=self.auth.sign_request("GET", "/stats", audience=self.audience)) as resp:
            return await resp.json()

    async def idle(self) -> dict:
        async def check():
            s = await self.stats()
            return s if s["inflight"] == 0 and s["num_free_blocks"] == s["num_blocks"] else None
        return await until(check, "the decode worker to go idle with every block free")


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
        transfer = await self.sender.begin(request.kv_transfer_id, self.receiver.address)
        self.hold.arm()
        src, dst = last_run(request.dst_block_ids)
        self.shipping.append(asyncio.ensure_future(transfer.send_blocks(src, dst)))
        await asyncio.wait_for(self.hold.holding.wait(), WAIT)

    async def reserved_blocks(self, request_id: str) -> int:
        """Blocks the engine still holds for ``request_id``'s reservation (0: freed)."""
        def count(e: Engine) -> int:
            return e.scheduler.kv.num_blocks_of(request_id) if request_id in e.scheduler.reservations else 0
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
    assert gone.request_id in peer.harness.worker.inflight  # its cleanup waits for the transfer
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
        transfer = await peer.sender.begin(request.kv_transfer_id, f"{kv.host}:{kv.port}")
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


class _Handle:
    """A transfer handle whose payload keeps landing until the test says it stopped."""

    def __init__(self):
        self.aborted = False
        self.stopped = asyncio.Event()

    def abort(self, reason: str = "") -> None:
        self.aborted = True

    def done(self) -> bool:
        return self.stopped.is_set()

    async def settled(self) -> None:
        await self.stopped.wait()


class _EngineThread:
    def __init__(self):
        self.calls = []

    async def call(self, fn):
        self.calls.append(fn)


async def test_release_frees_blocks_only_once_the_transfer_settled():
    """Unit test of the decode worker's side of the contract (UCX cannot divert a payload, so the
    handle may take up to ``abort_grace`` to settle): abort, wait for ``settled()``, then free."""
    from common.worker.metrics import WorkerMetrics
    from decode_svc.generate import release_reservation

    handle, engine_thread = _Handle(), _EngineThread()
    worker = type("W", (), {"metrics": WorkerMetrics(), "engine_thread": engine_thread})()
    release = asyncio.ensure_future(release_reservation(worker, "r1", handle))
    await until(lambda: asyncio.sleep(0, handle.aborted), "the abort")
    for _ in range(20):
        await asyncio.sleep(0)
    assert engine_thread.calls == [], "blocks freed while a payload could still land in them"
    assert worker.metrics.kv_transfers_settling._value.get() == 1
    handle.stopped.set()
    await asyncio.wait_for(release, WAIT)
    assert len(engine_thread.calls) == 1
    assert worker.metrics.kv_transfers_settling._value.get() == 0
