"""A reservation's lease against its KV landing: KV that has landed is never taken for late.

The lease on blocks reserved for a remote prompt frees them if the KV never comes.  Once the KV has
landed, the lease has nothing left to guard: the first token may come a little later (the prefill
worker answers after shipping), and the request joins the batch only between two engine steps.
If the lease ended in that window, a decode worker used to cut a healthy stream (and the gateway
benched it).  KV that comes after the lease ended is still refused: its first token never goes out.

The decode worker is the real handler in this process (``tests.support.inproc_decode``); the KV "lands"
when the test says (a stand-in receiver), the prefill peer answers when the test says, and the
engine thread reads leases against a clock the test moves -- so each test holds the exact order
of "KV landed", "lease ended" and "first token known" it is about.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import pytest

from common.cluster.messages import PrefillResult
from common.engine.kv.block_pool import BlockPool
from common.engine.config import EngineConfig, SchedulerConfig
from common.engine.engine import Engine
from common.engine.kv.kv_cache_manager import KVCacheManager
from common.engine.request import Request
from common.engine.sampling_params import SamplingParams
from common.engine.scheduler import Scheduler
from kvtransfer.receiver import TransferResult
from tests.support.inproc_decode import WAIT, DecodeHarness
from tests.support.waiting import until

FIRST_TOKEN = 42
PROMPT = list(range(5, 25))
MAX_TOKENS = 6


def test_a_stopped_lease_never_expires_and_the_reservation_still_lands():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=256, remote_lease_s=5.0),
                  KVCacheManager(BlockPool(16), 4))

    def reserve(rid: str, first: int) -> None:
        request = Request(rid, list(range(first, first + 8)), SamplingParams(max_tokens=4, ignore_eos=True))
        assert s.reserve_remote(request, now=100.0) is not None

    reserve("a", 10)
    reserve("b", 40)
    assert s.end_lease("a")  # a's KV landed
    assert s.next_lease_deadline() == 105.0  # b's: a's lease no longer runs
    assert s.expired_leases(now=1e9) == ["b"]
    assert s.next_lease_deadline() is None and not s.end_lease("b")  # b's KV is late: refused
    assert s.finish_remote("a", 7) is not None and s.finish_remote("b", 7) is None
    s.abort("b")
    s.check_integrity()


class Clock:
    """``time.monotonic()`` plus however far the test has moved it."""

    def __init__(self):
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


class HeldTransfer:
    """A stand-in for an ``IncomingTransfer`` whose KV lands when the test says."""

    def __init__(self):
        self.transfer_id = uuid.uuid4().hex
        self.landed = asyncio.Event()  # the test: the KV is all in
        self.seen = asyncio.Event()  # the decode worker has seen it (the same step it acts on it)
        self.aborted: str | None = None

    async def wait(self) -> TransferResult:
        await self.landed.wait()
        self.seen.set()
        return TransferResult(self.transfer_id, {}, nbytes=0, seconds=0.0)

    def done(self) -> bool:
        return self.landed.is_set() or self.aborted is not None

    def abort(self, reason: str = "") -> None:
        self.aborted = reason

    async def settled(self) -> None:
        return None  # nothing is ever half-landed here


class HeldReceiver:
    def __init__(self):
        self.transfers: list[HeldTransfer] = []

    def expect(self, request_id: str, block_ids: list[int]) -> HeldTransfer:
        self.transfers.append(HeldTransfer())
        return self.transfers[-1]


@pytest.fixture
async def harness(served_checkpoint, monkeypatch):
    engine = Engine(EngineConfig(model=str(served_checkpoint), num_blocks=64, block_size=4), load_tokenizer=False)
    clock, receiver = Clock(), HeldReceiver()
    harness = await DecodeHarness(engine, receiver, monkeypatch, clock=clock).start()
    harness.test_clock = clock
    harness.receiver = receiver
    answer = asyncio.Event()
    harness.answer = answer
    harness.asked = asyncio.Event()

    async def script(request):
        harness.asked.set()
        await answer.wait()
        return PrefillResult(first_token_id=FIRST_TOKEN)

    harness.script = script
    try:
        yield harness
    finally:
        answer.set()
        await harness.stop()


LEASE_CHECKS = 50  # lease checks a test makes before a lease that never ended fails it


async def lease_check(harness: DecodeHarness) -> None:
    """Move the clock past every lease and let the engine thread look at them; return once what
    it decided has reached the event loop (a lease it ended is given up by then)."""
    harness.test_clock.offset += 10 * harness.worker.reservation_lease_s
    await harness.engine_state(lambda e: None)  # the engine thread checks leases right after a command
    await harness.engine_state(lambda e: None)  # ... and anything it posted then has run before this answer


async def lease_state(harness: DecodeHarness, stream) -> str:
    """What a test that waited for a lease to end saw instead (for its failure message)."""
    leases, reservations = await harness.engine_state(
        lambda e: (dict(e.scheduler.handoff.decode.leases), list(e.scheduler.reservations)))
    task = stream.task
    ended = task.done() and (task.exception() if not task.cancelled() else "cancelled")
    return (f"no lease ended: leases {leases}, reservations {reservations}, lease clock "
            f"{harness.test_clock():.1f}, handler in flight {stream.request_id in harness.worker.in_flight}, "
            f"stream ended {ended!r}, frames {stream.frames}, aborts sent {harness.aborts}")


async def test_kv_that_landed_keeps_its_reservation_although_the_lease_ends_before_the_first_token(harness):
    stream = harness.generate(PROMPT, MAX_TOKENS)
    await asyncio.wait_for(harness.asked.wait(), WAIT)
    transfer = harness.receiver.transfers[0]
    transfer.landed.set()
    await asyncio.wait_for(transfer.seen.wait(), WAIT)
    # The KV is in; the first token is not known yet, and the lease ends now.
    await lease_check(harness)
    assert await harness.engine_state(lambda e: len(e.scheduler.reservations)) == 1, "the reservation was given up"
    harness.answer.set()
    tokens = await stream.tokens()
    assert len(tokens) == MAX_TOKENS and tokens[0] == FIRST_TOKEN
    assert stream.frames[0].prefill_worker == "p-scripted" and not stream.frames[0].prefill_fallback
    assert transfer.aborted is None and harness.aborts == []
    await harness.idle()


async def test_kv_that_lands_after_the_lease_ended_is_refused_before_its_first_token_goes_out(harness):
    """The lease ends while the KV is still on its way; the KV lands, and the first token is known,
    before the decode worker has acted on the lease's end: nothing may be streamed (the request is
    given up as for any expired lease), and the blocks come back."""
    worker = harness.worker
    held_expiries: list[list[str]] = []
    worker.engine_thread.on_lease_expired = held_expiries.append  # acted on when the test says
    stream = harness.generate(PROMPT, MAX_TOKENS)
    await asyncio.wait_for(harness.asked.wait(), WAIT)
    await lease_check(harness)
    # On a loaded machine the engine thread may look at the leases only at its next command: each
    # further check is one more (bounded: a lease that never ends still fails the test).
    for _ in range(LEASE_CHECKS):
        if held_expiries:
            break
        await lease_check(harness)
    assert len(held_expiries) == 1, await lease_state(harness, stream)
    transfer = harness.receiver.transfers[0]
    transfer.landed.set()
    harness.answer.set()
    # The handler either has given the request up by itself, or would have sent the first token.
    async def handled():
        return stream.task.done() or stream.first.is_set() or stream.request_id not in worker.in_flight
    await until(handled, "the handler to act on its late KV")
    assert not stream.first.is_set(), f"a first token went out on late KV: {stream.frames}"
    worker._leases_expired(held_expiries[0])  # what the engine thread had posted
    with contextlib.suppress(Exception):
        await asyncio.wait_for(stream.task, WAIT)
    assert not [f for f in stream.frames if f.token_ids], stream.frames
    assert harness.aborts == [stream.request_id]  # the prefill worker is told
    await harness.idle()
