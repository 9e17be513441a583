"""Every batch of blocks the prefill worker ships carries a fence recorded after the step that
wrote them (on CUDA the sender waits on it before UCX or the staging copy reads device memory);
a request that ends with an error gives its blocks back and fails its transfer at once.

The engine runs a chunked prefill here on CPU, where ``record_fence`` is replaced by a stand-in
that names the step it was recorded in; the test checks, block by block, that the fence of each
shipped batch comes after the forward that wrote the block's last token.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.sampling_params import SamplingParams
from common.cluster.registry import KVAddress
from prefill_svc import shipping
from prefill_svc.shipping import ENDED, FINAL, RequestEnded, Shipper, ShippingJob

BLOCK = 4


@pytest.fixture(scope="module")
def engine(served_checkpoint):
    return Engine(EngineConfig(model=str(served_checkpoint), num_blocks=64, block_size=BLOCK,
                               max_num_batched_tokens=10), load_tokenizer=False)


def test_each_shipped_batch_waits_for_the_step_that_wrote_it(engine, monkeypatch):
    steps = {"n": 0}  # forwards run so far
    monkeypatch.setattr(shipping, "record_fence", lambda device: ("fence after forward", steps["n"]))
    written_in: dict[int, int] = {}  # block index of the prompt -> forward that wrote its last slot

    def on_kv_written(out):
        steps["n"] += 1
        for item in out.scheduled:
            last = item.num_computed_tokens + len(item.token_ids) - 1
            for position in range(item.num_computed_tokens, last + 1):
                written_in[position // BLOCK] = steps["n"]
        shipper.on_kv_written(out)

    shipper = Shipper(SimpleNamespace(model=SimpleNamespace(device=engine.device)))
    engine.runner.on_kv_written.append(on_kv_written)
    posted: list = []
    prompt = list(range(3, 40))  # 37 tokens: 10 blocks, computed 10 tokens per step
    job = ShippingJob("r", "0" * 32, KVAddress("tcp", "127.0.0.1", 1), list(range(10)), 0,
                      asyncio.new_event_loop())
    job.post = posted.append
    try:
        request = engine.make_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), "r")
        shipper.start(engine, job, request)
        while engine.has_work():
            shipper.after_step(engine, engine.step())
    finally:
        engine.runner.on_kv_written.remove(on_kv_written)
        job.loop.close()

    assert posted[-1] is FINAL
    batches = posted[:-1]
    assert len(batches) > 1, "the prompt should have shipped chunk by chunk"
    shipped = []
    for src, dst, blocks, fence in batches:
        assert fence is not None and fence[0] == "fence after forward"
        for index in dst:
            assert fence[1] >= written_in[index], f"block {index} shipped with a fence before its write"
        shipped += dst
        engine.block_pool.free(blocks)  # the pins the sender would drop
    assert shipped == list(range(10))


class FailedGrammar:
    """A grammar that failed (past the limits on its work) at the request's first token."""

    def fill_bitmask(self, bitmask, row):
        bitmask[row].fill_(-1)

    def accept(self, token_id):
        return False

    def error(self):
        return None

    def is_stopped(self):
        return False

    def may_end(self):
        return False


def test_a_request_that_ends_with_an_error_gives_its_blocks_back_and_fails_its_transfer(engine):
    shipper = Shipper(SimpleNamespace(model=SimpleNamespace(device=engine.device)))
    posted: list = []
    job = ShippingJob("e", "0" * 32, KVAddress("tcp", "127.0.0.1", 1), list(range(10)), 0, asyncio.new_event_loop())
    job.post = posted.append
    free = engine.block_pool.num_free_blocks
    try:
        request = engine.make_request(list(range(3, 40)), SamplingParams(max_tokens=1, temperature=1.0), "e")
        request.grammar = FailedGrammar()
        shipper.start(engine, job, request)
        while engine.has_work():
            shipper.after_step(engine, engine.step())
    finally:
        job.loop.close()
    assert request.status.finish_reason == "error" and posted[-1] is ENDED["error"] and not shipper.jobs
    for _src, _dst, blocks, _fence in posted[:-1]:
        engine.block_pool.free(blocks)  # the pins the sender drops
    assert engine.block_pool.num_free_blocks == free  # none held for a transfer that will not come


class StepInProgress:
    """An engine thread in the middle of a long step: commands queue until ``end_step``."""

    def __init__(self, engine):
        self.engine = engine
        self.queued: list = []

    async def call(self, fn):
        future = asyncio.get_running_loop().create_future()
        self.queued.append((fn, future))
        return await future

    def end_step(self) -> None:
        for fn, future in self.queued:
            future.set_result(fn(self.engine))
        self.queued.clear()


class RecordingTransfer:
    def __init__(self):
        self.sent: list[list[int]] = []
        self.finished = None

    async def send_blocks(self, src, dst, fence):
        self.sent.append(list(dst))

    async def finish(self, metadata=None):
        self.finished = metadata or {}

    def abort(self, reason):
        raise AssertionError(f"aborted: {reason}")


async def test_the_first_token_goes_out_without_waiting_for_the_next_step():
    """The last batch's unpin runs between steps, but the transfer finishes (and the first token
    leaves) while another request's step is still running; the blocks are unpinned when it ends."""
    unpinned: list = []
    engine = SimpleNamespace(scheduler=SimpleNamespace(handoff=SimpleNamespace(prefill=SimpleNamespace(unpin=unpinned.append))))
    transfer = RecordingTransfer()
    background: set = set()

    async def begin(transfer_id, address):
        return transfer

    def spawn(coro):
        task = asyncio.ensure_future(coro)
        background.add(task)
        return task

    context = SimpleNamespace(engine=StepInProgress(engine), kv_sender=SimpleNamespace(begin=begin), spawn=spawn)
    job = ShippingJob("r", "0" * 32, KVAddress("tcp", "127.0.0.1", 1), [7, 8, 9], 0, asyncio.get_running_loop())
    blocks = ["block 0", "block 1", "block 2"]
    job.queue.put_nowait(([0, 1], [7, 8], blocks[:2], None))
    job.queue.put_nowait(([2], [9], blocks[2:], None))
    job.queue.put_nowait(FINAL)

    sent = await asyncio.wait_for(shipping.ship(context, job), timeout=10)

    assert sent == 3 and transfer.sent == [[7, 8], [9]] and transfer.finished == {}  # the first token goes in the /prefill answer only
    await asyncio.sleep(0)  # the unpin tasks queue their commands ...
    assert unpinned == [] and len(context.engine.queued) == 2  # ... which wait for the step's end
    context.engine.end_step()
    await asyncio.wait_for(asyncio.gather(*background), timeout=10)
    assert unpinned == [blocks[:2], blocks[2:]]


async def test_a_transfer_whose_request_ended_fails_at_once_and_says_whether_its_output_follows():
    aborted: list = []
    transfer = RecordingTransfer()
    transfer.abort = aborted.append
    context = SimpleNamespace(kv_sender=SimpleNamespace(begin=lambda *_: asyncio.sleep(0, transfer)))
    for reason, with_output in (("error", True), ("abort", False)):
        job = ShippingJob("r", "0" * 32, KVAddress("tcp", "127.0.0.1", 1), [7], 0, asyncio.get_running_loop())
        job.queue.put_nowait(ENDED[reason])
        with pytest.raises(RequestEnded) as info:
            await asyncio.wait_for(shipping.ship(context, job), timeout=10)
        assert info.value.with_output is with_output
    assert len(aborted) == 2 and transfer.finished is None  # the receiver is told, never that it is complete


async def test_a_prefill_whose_worker_began_to_drain_during_its_lookup_is_refused(monkeypatch):
    """The decode worker's registry entry is looked up before the prefill is tracked: a drain that
    began meanwhile found nothing in flight and reported idle, and the prefill then ran anyway."""
    from common.cluster.messages import PrefillRequest, encode
    from prefill_svc import prefill

    state = {"draining": False}

    async def lookup(_worker_id):
        state["draining"] = True  # the drain begins, and finds nothing in flight
        return object()

    tracked = []
    context = SimpleNamespace(accepts=lambda kind: ("refused", "worker is draining") if state["draining"] else None,
                              peers=SimpleNamespace(get=lookup), in_flight=SimpleNamespace(track=tracked.append),
                              model=SimpleNamespace(vocab_size=1000, block_size=BLOCK),
                              config=SimpleNamespace(kv=SimpleNamespace(transport="tcp")))
    monkeypatch.setattr(prefill, "check_prefill_request", lambda *args, **kwargs: KVAddress("tcp", "127.0.0.1", 1))
    body = encode(PrefillRequest(request_id="p", prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(),
                                 decode_worker_id="d0", dst_block_ids=[0], transfer_id="0" * 32))

    class Posted:
        async def read(self):
            return body

    answer = await prefill.handle_prefill(context, shipper=None, request=Posted())
    assert answer.status == 503 and tracked == []
