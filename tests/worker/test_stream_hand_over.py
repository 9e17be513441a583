"""A decode worker's side of stream migration (``decode_svc.generate``): a drain ends each stream
whose gateway may move it with a "migrate" frame right after the tokens it sent, frees its blocks
at once, and leaves the other streams decoding to their end; a stream resumed after those tokens
(``resume_token_ids``) continues exactly where it stopped; the drain waits for the handed-over
stream's KV to be fetched from here (a live move, tested between processes in
tests/serving/test_serving_faults.py).  The worker is the real handler in this process (``tests.support.inproc_decode``)."""
from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from tests.support.inproc_decode import WAIT, DecodeHarness
from tests.support.waiting import until

PROMPT = list(range(5, 25))
MAX_TOKENS = 200


def slow_steps(harness: DecodeHarness) -> None:
    """Steps of 10 ms at least: a stream of MAX_TOKENS outlasts the drain's hand-over (and its
    control timeout) many times over -- the tiny model alone can decode every token first."""
    harness.engine.fault_injector = lambda _step: time.sleep(0.01)


@pytest.fixture
async def harness(served_checkpoint, monkeypatch):
    engine = Engine(EngineConfig(model=str(served_checkpoint), num_blocks=128, block_size=4), load_tokenizer=False)
    harness = await DecodeHarness(engine, receiver=None, monkeypatch=monkeypatch).start()
    try:
        yield harness
    finally:
        await harness.stop()


async def test_a_drain_hands_movable_streams_over_and_a_resumed_stream_goes_on(harness):
    whole = await harness.generate(PROMPT, MAX_TOKENS, remote=False).tokens()
    slow_steps(harness)
    movable = harness.generate(PROMPT, MAX_TOKENS, remote=False, may_migrate=True)
    pinned = harness.generate(PROMPT, MAX_TOKENS, remote=False)  # its gateway cannot move it
    await asyncio.wait_for(movable.first.wait(), WAIT)
    await asyncio.wait_for(pinned.first.wait(), WAIT)
    drained = harness.worker.begin_drain()
    # First the stream is told it moves soon, and decodes on while its gateway pre-copies its KV
    # (between processes: tests/serving/test_serving_faults.py); here that copy ends at once.
    await until(lambda: movable.request_id in harness.worker.precopies_due, "the stream told it moves soon")
    assert harness.worker.precopies_due == {movable.request_id}  # not the stream its gateway cannot move
    harness.worker.exported(movable.request_id)

    frames = await asyncio.wait_for(movable.task, WAIT)
    assert frames[-1].error_kind == "migrate" and not frames[-1].finished
    assert [f.move_soon for f in frames].count(True) == 1 and not frames[-1].move_soon
    sent = [t for f in frames for t in f.token_ids]
    assert sent == whole[:len(sent)] and len(sent) < MAX_TOKENS  # handed over mid-stream
    assert await pinned.tokens() == whole  # decoded to its end here
    await harness.idle()  # every block of the handed-over stream freed (to the prefix cache)
    # The stream's new worker may still fetch its KV from here: the drain waits for that call.
    await until(lambda: not harness.worker.in_flight, "nothing in flight")
    await asyncio.sleep(0.1)
    assert not drained.done() and harness.worker.exports_due == {movable.request_id}
    harness.worker.exported(movable.request_id)
    await asyncio.wait_for(drained, WAIT)
    assert harness.worker.state == "idle" and harness.worker.metrics.snapshot()["streams_handed_over"] == 1

    await harness.worker.set_role("decode")  # active again: the stream comes back, resumed
    rest = await harness.generate(PROMPT, MAX_TOKENS, remote=False, resume_token_ids=sent).tokens()
    assert sent + rest == whole


async def test_a_resume_the_request_could_not_have_reached_is_refused(harness):
    bad = await asyncio.wait_for(harness.generate(PROMPT, 3, remote=False, resume_token_ids=[7, 8, 9]).task, WAIT)
    assert bad[-1].error_kind == "invalid" and "resume_token_ids" in bad[-1].error  # max_tokens reached already
    await until(lambda: not harness.worker.in_flight, "nothing in flight")


async def test_streams_whose_kv_nobody_pre_copies_are_handed_over_all_the_same(harness, monkeypatch):
    """A gateway that does not pre-copy (or fails to) delays the hand-over by at most the control
    timeout without progress; it never keeps the stream decoding to its end here."""
    monkeypatch.setattr(harness.worker, "config", dataclasses.replace(harness.worker.config, control_timeout_s=0.2))
    slow_steps(harness)
    movable = harness.generate(PROMPT, MAX_TOKENS, remote=False, may_migrate=True)
    await asyncio.wait_for(movable.first.wait(), WAIT)
    drained = harness.worker.begin_drain()
    frames = await asyncio.wait_for(movable.task, WAIT)
    assert frames[-1].error_kind == "migrate" and any(f.move_soon for f in frames)
    assert len([t for f in frames for t in f.token_ids]) < MAX_TOKENS
    assert not harness.worker.precopies_due
    harness.worker.exported(movable.request_id)  # its new worker's fetch of the KV
    await asyncio.wait_for(drained, WAIT)


async def test_a_drained_worker_takes_a_moved_stream_back_as_the_last_resort_but_no_new_request(harness):
    """Where the worker a drain handed a stream to died, the gateway sends it back here (no active
    decode worker is left): it decodes it to its end.  A new request is still refused, and so is
    the stream once the worker shuts down (its drain ends with the process)."""
    whole = await harness.generate(PROMPT, 40, remote=False).tokens()
    await asyncio.wait_for(harness.worker.begin_drain(), WAIT)
    assert harness.worker.state == "idle"
    slow_steps(harness)
    moved = harness.generate(PROMPT, 40, remote=False, resume_token_ids=whole[:7], last_resort=True)  # (as sent)
    # (its entry must not say idle while it decodes: it drains again)
    await until(lambda: moved.request_id in harness.worker.in_flight and harness.worker.state == "draining",
                "the moved stream decoding on a draining worker")
    assert whole[:7] + await moved.tokens() == whole
    await until(lambda: harness.worker.state == "idle", "the worker idle again")
    for fields in ({}, {"resume_token_ids": whole[:7]}):  # a new request; a moved stream sent as to any worker
        refused = await asyncio.wait_for(harness.generate(PROMPT, 40, remote=False, **fields).task, WAIT)
        assert refused[-1].error_kind == "refused" and "idle" in refused[-1].error
    harness.worker.shutting_down = True
    late = harness.generate(PROMPT, 40, remote=False, resume_token_ids=whole[:7], last_resort=True)
    assert (await asyncio.wait_for(late.task, WAIT))[-1].error_kind == "refused"
    await harness.idle()
