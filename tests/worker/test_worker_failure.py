"""A real decode worker whose engine steps fail or hang on cue (``PDSERVE_TEST_FAIL_STEPS``,
``PDSERVE_TEST_HANG_STEPS``).

One failed step ends the requests in it with an explicit error and the worker keeps serving.
Failures in a row (``--max-step-failures``), or a step that outlives the watchdog's bound
(``--engine-watchdog``: a hung engine thread, which cannot report itself), fail the worker: it
leaves the registry, /health answers 503, every request in flight or arriving gets an explicit
error at once, and the process exits non-zero once the last in-flight request has its answer (so
its supervisor restarts it) -- also when a thread of its event loop's default executor never
returns, as one waiting on a hung GPU kernel's fence would (``PDSERVE_TEST_STUCK_EXECUTOR``): the
interpreter's shutdown used to wait for it forever, and the worker, out of the registry, was never
restarted.

A request whose remote prefill hangs (a scripted prefill peer) keeps the worker in its drain long
enough to look at it (and, holding more blocks than reservations may, shows that another remote
prefill is answered "busy"); releasing the peer lets that request end, and the process exit.
"""
from __future__ import annotations

import asyncio
import uuid

import pytest

from common.cluster.auth import ClusterAuth
from common.cluster.messages import GenerateRequest, TokenFrame, encode, read_frame
from common.cluster.redis_util import connect
from common.cluster.registry import WorkerRegistry
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.sampling_params import SamplingParams
from tests.support.cluster import PREWARMED, LocalStack, delete_keys
from tests.support.waiting import until
from tests.support.scripted_peer import BLOCK_SIZE, NUM_BLOCKS, ScriptedPeer, WorkerClient

pytestmark = pytest.mark.slow(seconds=10)  # a long file: scheduled by its length (tests/conftest.py)

WAIT = 120.0
# Step 2 fails alone; from step 4 on every step fails, and 3 in a row fail the worker.
FAIL_STEPS = "2,4-"
WORKER_ARGS = ["--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "1",
               "--max-step-failures", "3", "--failure-drain-timeout", str(WAIT), "--heartbeat-ttl", "60",
               "--kv-timeout", str(WAIT)]


# The first step hangs; the watchdog gives it FIRST_STEP_ALLOWANCE times this (the only other
# work before it, a few engine calls, takes microseconds).
WATCHDOG_S = 2.0


def worker_stack(checkpoint, redis_url, workdir, env: dict[str, str], args: list[str]):
    stack = LocalStack(str(checkpoint), redis_url, key_prefix=f"pdtest-{uuid.uuid4().hex[:12]}",
                       workdir=workdir, prefill=0, decode=0, transport="tcp", worker_args=WORKER_ARGS + args,
                       spawner=PREWARMED, extra_env={"OMP_NUM_THREADS": "1", **env})
    try:
        stack.start_worker("d0", "decode")
        stack.wait_ready("d0", timeout=WAIT)
        yield stack
    finally:
        stack.stop()
        delete_keys(redis_url, stack.key_prefix)


@pytest.fixture
def stack(served_checkpoint, redis_url, tmp_path):
    yield from worker_stack(served_checkpoint, redis_url, tmp_path, {"PDSERVE_TEST_FAIL_STEPS": FAIL_STEPS}, [])


@pytest.fixture
def hang_stack(served_checkpoint, redis_url, tmp_path):
    yield from worker_stack(served_checkpoint, redis_url, tmp_path,
                            {"PDSERVE_TEST_HANG_STEPS": "1", "PDSERVE_TEST_STUCK_EXECUTOR": "1"},
                            ["--engine-watchdog", str(WATCHDOG_S)])


async def generate(client: WorkerClient, prompt_id: int, prefill_worker_id: str | None = None,
                   max_tokens: int = 1, prompt_len: int = 3, request_id: str | None = None,
                   ) -> tuple[int, list[TokenFrame]]:
    body = GenerateRequest(request_id=request_id or f"t-{uuid.uuid4().hex[:8]}",
                           prompt_token_ids=[prompt_id] + [7] * (prompt_len - 1),
                           sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                           prefill_worker_id=prefill_worker_id)
    frames = []
    async with client.post("/generate", encode(body)) as resp:
        while (frame := await read_frame(resp.content, TokenFrame)) is not None:
            frames.append(frame)
            if frame.finished or frame.error:
                break
        return resp.status, frames


def outcome(frames: list[TokenFrame]) -> str:
    errors = [f for f in frames if f.error]
    if errors:
        return f"{errors[-1].error_kind}: {errors[-1].error}"
    return "ok" if frames and frames[-1].finished else "cut"


async def registered(stack: LocalStack) -> set[str]:
    redis = connect(stack.redis_url)
    try:
        registry = WorkerRegistry(redis, key_prefix=stack.key_prefix, ttl_s=60,
                                  auth=ClusterAuth(stack.cluster_secret))
        return {w.worker_id for w in await registry.list_workers(stack.model_name)}
    finally:
        await redis.aclose()


async def left_the_registry(stack: LocalStack) -> bool:
    return "d0" not in await registered(stack)


async def test_failed_steps_error_their_requests_then_repeated_failures_fail_the_worker(stack, served_checkpoint):
    engine = Engine(EngineConfig(model=str(served_checkpoint), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE),
                    load_tokenizer=False)
    peer = await ScriptedPeer(engine, stack).start()
    peer.script = lambda request: peer.hang()
    async with WorkerClient(stack) as client:
        # Step 1 succeeds, step 2 fails (that request alone gets the error), step 3 succeeds.
        assert outcome((await generate(client, 10))[1]) == "ok"
        _, frames = await generate(client, 11)
        assert outcome(frames).startswith("failed: engine step failed") and "injected fault in step 2" in outcome(frames)
        assert outcome((await generate(client, 12))[1]) == "ok"
        stats = stack.worker_json("d0", "/stats?check=1")
        assert stats["pool_ok"] and stats["num_free_blocks"] == stats["num_blocks"], stats
        assert stats["engine_step_failures"] == 1 and stack.worker_json("d0", "/health")["status"] == "ok"
        assert "d0" in await registered(stack)

        # A request that waits for its (hung) remote prefill: in flight, but in no engine step.
        # Its reservation (10 of 16 blocks) is over the remote budget (half the pool): the first
        # is let in, but another remote prefill now gets "busy" at once, not a local fallback.
        hung = asyncio.ensure_future(generate(client, 13, prefill_worker_id=peer.worker_id, max_tokens=4,
                                              prompt_len=40))
        await until(lambda: stack.stats("d0")["num_waiting_for_remote_kv"], "the request to wait for its remote KV")
        for _ in range(2):  # the gateway may retry at once with the same id: busy again, not "in flight"
            status, frames = await generate(client, 14, prefill_worker_id=peer.worker_id, request_id="busy-1")
            assert status == 503 and outcome(frames).startswith("busy: no free KV blocks"), outcome(frames)
        stats = stack.stats("d0")
        assert stats["num_waiting_for_remote_kv"] == 1 and stats["inflight"] == 1, stats
        assert stats["remote_prefill_fallbacks"] == 0, stats
        # Steps 4, 5, 6 fail in a row (one request each: --max-num-seqs 1); the fourth request
        # waits behind them when the engine gives up.
        results = await asyncio.wait_for(asyncio.gather(*(generate(client, 20 + i) for i in range(4))), WAIT)
        outcomes = sorted(outcome(frames).split(":")[0] for _, frames in results)
        assert outcomes == ["failed", "failed", "failed", "refused"], [outcome(f) for _, f in results]

        # Failed: out of the registry, 503 on /health, new requests refused at once.
        await until(lambda: left_the_registry(stack), "d0 to leave the registry")
        status, frames = await generate(client, 30)
        assert status == 503 and outcome(frames).startswith("refused: worker failed"), outcome(frames)
        async with client.session.get(client.url + "/health") as resp:
            health = await resp.json()
            assert resp.status == 503 and health["status"] == "engine failed", health
        stats = stack.stats("d0")
        assert "steps failed in a row" in stats["failed"] and stats["inflight"] == 1
        assert stack.procs["d0"].alive  # still draining: the hung request is in flight

        # The peer gives up: the last request ends with an explicit error, and the process exits 1.
        await peer.close()
        _, frames = await asyncio.wait_for(hung, WAIT)
        assert outcome(frames).startswith("refused"), outcome(frames)
    assert await asyncio.to_thread(stack.procs["d0"].popen.wait, WAIT) == 1


async def test_a_hung_engine_step_fails_the_worker(hang_stack, served_checkpoint):
    stack = hang_stack
    engine = Engine(EngineConfig(model=str(served_checkpoint), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE),
                    load_tokenizer=False)
    peer = await ScriptedPeer(engine, stack).start()
    peer.script = lambda request: peer.hang()
    async with WorkerClient(stack) as client:
        assert "d0" in await registered(stack) and stack.worker_json("d0", "/health")["status"] == "ok"
        # A request that waits for its (hung) remote prefill: in flight, in no engine step; it keeps
        # the failed worker in its drain long enough to look at it.
        hung = asyncio.ensure_future(generate(client, 13, prefill_worker_id=peer.worker_id, max_tokens=4,
                                              prompt_len=40))
        await until(lambda: stack.stats("d0")["num_waiting_for_remote_kv"], "the request to wait for its remote KV")
        # The first step hangs: the request in it, and the one waiting behind it, get an explicit
        # error once the watchdog gives up on the engine thread (not never).
        results = await asyncio.wait_for(asyncio.gather(generate(client, 20), generate(client, 21)), WAIT)
        for _, frames in results:
            assert outcome(frames).startswith("refused: engine failed: the engine thread is hung: step 1 "), (
                outcome(frames))  # the hung one, named: not a later one, nor a command

        await until(lambda: left_the_registry(stack), "d0 to leave the registry")
        status, frames = await generate(client, 30)
        assert status == 503 and outcome(frames).startswith("refused: worker failed"), outcome(frames)
        async with client.session.get(client.url + "/health") as resp:
            health = await resp.json()
            assert resp.status == 503 and health["status"] == "engine failed", health
        stats = stack.stats("d0")
        assert "hung" in stats["failed"] and stats["inflight"] == 1, stats
        assert stack.procs["d0"].alive  # still draining: the hung request is in flight

        # The peer gives up: the last request ends with an explicit error, and the process exits 1
        # although its engine thread never returns, nor a thread of its default executor.
        await peer.close()
        _, frames = await asyncio.wait_for(hung, WAIT)
        assert outcome(frames).startswith("refused"), outcome(frames)
    assert await asyncio.to_thread(stack.procs["d0"].popen.wait, WAIT) == 1
