"""A remote prompt's first token leaves the decode worker as soon as its KV has landed, not when
the engine's step in flight ends (a colocated worker's step may carry a long prompt chunk).

The decode worker here is the real ``/generate`` handler on a real ``Worker`` (not started: no
Redis, no registry) with a real engine and ``EngineThread``; the engine's steps can be held
mid-step on cue.  The prefill peer is scripted: it answers with a first token once the engine is
held in another request's step, and its KV "lands" at once (a stand-in receiver), so the test
controls exactly where the engine is when the first token is known.
"""
from __future__ import annotations

import asyncio
import threading
import uuid
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from common.cluster.messages import GenerateRequest, PrefillResult, TokenFrame, encode, read_frame
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.sampling_params import SamplingParams
from worker.config import WorkerConfig
from worker.engine_thread import EngineThread
from worker.lifecycle import Worker
from decode_svc import generate, prefill_client
from decode_svc.role import DECODE
from kvtransfer.config import KVTransferConfig
from kvtransfer.receiver import TransferResult

WAIT = 30.0
FIRST_TOKEN = 42
PROMPT = list(range(5, 25))


class StepGate:
    """Holds the engine's next step, once armed, until ``release()`` (threads: engine and test)."""

    def __init__(self, engine: Engine):
        self._step = engine.step
        self.armed = False
        self.entered = threading.Event()
        self.released = threading.Event()
        engine.step = self._gated_step

    def _gated_step(self):
        if self.armed:
            self.armed = False
            self.entered.set()
            self.released.wait(4 * WAIT)  # past any read of the test: a held step fails it, not passes
        return self._step()

    def release(self) -> None:
        self.released.set()


class LandedAtOnce:
    """A KV receiver whose transfers complete at once (the scripted peer sends nothing)."""

    def expect(self, request_id: str, block_ids: list[int]):
        transfer_id = uuid.uuid4().hex

        async def wait():
            return TransferResult(transfer_id, {}, nbytes=0, seconds=0.0)

        return SimpleNamespace(transfer_id=transfer_id, wait=wait, abort=lambda reason: None,
                               done=lambda: True)


@pytest.fixture
async def decode_worker(served_checkpoint, monkeypatch):
    """``(url, worker, gate, peer_answered)``: a decode worker whose prefill peer answers with
    ``FIRST_TOKEN`` only once the engine is held mid-step (in a background request's step)."""
    engine = Engine(EngineConfig(model=str(served_checkpoint), num_blocks=64, block_size=4), load_tokenizer=False)
    worker = Worker(WorkerConfig(engine=engine.config, kv=KVTransferConfig(transport="tcp"), role="decode"), [DECODE])
    loop = asyncio.get_running_loop()
    worker.engine = engine
    worker.engine_thread = EngineThread(engine, loop)
    worker.kv_receiver = LandedAtOnce()
    peer = SimpleNamespace(worker_id="p-scripted", instance="scripted", heartbeat_at=0.0, expires_at=5.0)
    worker.peers = SimpleNamespace(forget=lambda worker_id: None, get=lambda worker_id: asyncio.sleep(0, peer))
    worker.state = "active"
    gate = StepGate(engine)
    peer_answered = asyncio.Event()

    async def resolve_prefill_worker(worker, worker_id, moved_stream=False):
        return peer

    async def call_prefill(context, peer, request):
        # Another request streams on this worker; the prefill answers while its step is running.
        gate.armed = True
        await context.engine.call(lambda e: e.add_request(
            list(range(3, 40)), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True), "background"))
        assert await asyncio.to_thread(gate.entered.wait, WAIT), "the background request never stepped"
        peer_answered.set()
        return PrefillResult(first_token_id=FIRST_TOKEN)

    monkeypatch.setattr(generate, "resolve_prefill_worker", resolve_prefill_worker)
    monkeypatch.setattr(prefill_client, "call_prefill", call_prefill)
    worker.engine_thread.start()
    app = web.Application()
    DECODE.install(worker.role_context(), app)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        yield url, worker, gate, peer_answered
    finally:
        gate.release()
        await runner.cleanup()
        worker.engine_thread.stop()


def generate_body(sampling: SamplingParams) -> bytes:
    return encode(GenerateRequest(request_id=f"t-{uuid.uuid4().hex[:8]}", prompt_token_ids=PROMPT,
                                  sampling_params=sampling, prefill_worker_id="p-scripted"))


async def all_freed(worker: Worker) -> None:
    while worker.in_flight or worker.engine.scheduler.requests:
        await asyncio.sleep(0.02)


async def test_the_first_token_goes_out_while_the_engine_is_mid_step(decode_worker):
    url, worker, gate, peer_answered = decode_worker
    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/generate", data=generate_body(sampling)) as resp:
            assert resp.status == 200
            first = await asyncio.wait_for(read_frame(resp.content, TokenFrame), WAIT)
            # The engine is still held in the background request's step: the request has not
            # joined the batch yet, and its first token is already out.
            assert not gate.released.is_set()
            assert first.token_ids == [FIRST_TOKEN] and not first.finished and first.error is None
            assert first.prefill_worker == "p-scripted" and first.num_prompt_tokens == 20
            assert len(worker.engine.scheduler.reservations) == 1
            gate.release()
            frames = [first]
            while not frames[-1].finished:
                frame = await asyncio.wait_for(read_frame(resp.content, TokenFrame), WAIT)
                assert frame is not None and frame.error is None, frame
                frames.append(frame)
    tokens = [t for f in frames for t in f.token_ids]
    assert len(tokens) == 6 and tokens[0] == FIRST_TOKEN and frames[-1].finish_reason == "length"
    await asyncio.wait_for(all_freed(worker), WAIT)  # the background request finishes too


@pytest.mark.parametrize("sampling, reason", [
    (SamplingParams(max_tokens=1, temperature=0.0), "length"),
    (SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(FIRST_TOKEN,)), "stop"),
])
async def test_a_first_token_that_ends_the_request_goes_out_once_it_has_landed(decode_worker, sampling, reason):
    url, worker, gate, peer_answered = decode_worker
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/generate", data=generate_body(sampling)) as resp:
            assert resp.status == 200
            reading = asyncio.ensure_future(read_frame(resp.content, TokenFrame))
            await asyncio.wait_for(peer_answered.wait(), WAIT)
            # Held mid-step, the engine cannot land the request; nothing may go out before it has
            # (the finished frame is the last one, and the blocks become prefix cache on landing).
            done, _ = await asyncio.wait([reading], timeout=0.5)
            assert not done and len(worker.engine.scheduler.reservations) == 1
            gate.release()
            first = await asyncio.wait_for(reading, WAIT)
    assert first.token_ids == [FIRST_TOKEN] and first.finished and first.finish_reason == reason
    await asyncio.wait_for(all_freed(worker), WAIT)
    # Landed, the prompt's blocks became prefix cache (the engine thread is idle: safe to look).
    probe = worker.engine.make_request(PROMPT, sampling, "probe")
    assert len(worker.engine.scheduler.kv_manager.find_cached_prefix(probe)) * 4 >= len(PROMPT) - 4
