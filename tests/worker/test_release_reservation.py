"""The decode worker's side of the KV receiver's contract (``decode_svc.generate.release_reservation``):
a given-up transfer's blocks are freed only once nothing more can land in them -- after the handle
has settled (UCX cannot divert a payload, so that may take up to ``abort_grace``), and, where a
payload whose sender froze mid-way is still landing when it settles (``still_landing``), only once
that payload has ended.  Unit tests: a handle the test drives, over a real scheduler's blocks.
"""
from __future__ import annotations

import asyncio

from common.engine.config import SchedulerConfig
from common.engine.kv.block_pool import BlockPool
from common.engine.kv.kv_cache_manager import KVCacheManager
from common.engine.request import Request
from common.engine.sampling_params import SamplingParams
from common.engine.scheduler import Scheduler
from decode_svc.generate import release_reservation
from tests.support.waiting import WAIT_S, until
from worker.metrics import WorkerMetrics

NUM_BLOCKS = 16


class _Handle:
    """A transfer handle whose payload keeps landing until the test says it stopped."""

    def __init__(self, block_ids: list[int]):
        self.block_ids = block_ids
        self.aborted = False
        self.stopped = asyncio.Event()
        self.still_landing: asyncio.Future | None = None

    def abort(self, reason: str = "") -> None:
        self.aborted = True

    def done(self) -> bool:
        return self.stopped.is_set()

    async def settled(self) -> None:
        await self.stopped.wait()


class _Engine:
    """What ``release_reservation`` asks of the engine, on a real scheduler."""

    def __init__(self):
        config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64, remote_kv_budget=1.0)
        self.scheduler = Scheduler(config, KVCacheManager(BlockPool(NUM_BLOCKS), 4))

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id) is not None

    @property
    def free_blocks(self) -> int:
        self.scheduler.check_integrity()
        return self.scheduler.kv_manager.pool.num_free_blocks


class _EngineThread:
    def __init__(self, engine: _Engine):
        self.engine = engine
        self.calls = 0

    async def call(self, fn):
        self.calls += 1
        return fn(self.engine)


def _reserved(engine: _Engine, request_id: str, first_token: int) -> list[int]:
    request = Request(request_id, list(range(first_token, first_token + 20)), SamplingParams(max_tokens=4, ignore_eos=True))
    block_ids, _ = engine.scheduler.reserve_remote(request)
    return block_ids


def _worker(engine: _Engine):
    return type("W", (), {"metrics": WorkerMetrics(), "engine": _EngineThread(engine),
                          "spawn": staticmethod(asyncio.ensure_future)})()


async def test_release_frees_blocks_only_once_the_transfer_settled():
    engine = _Engine()
    handle = _Handle(_reserved(engine, "r1", 100))
    worker = _worker(engine)
    release = asyncio.ensure_future(release_reservation(worker, "r1", handle))
    await until(lambda: asyncio.sleep(0, handle.aborted), "the abort")
    for _ in range(20):
        await asyncio.sleep(0)
    assert worker.engine.calls == 0, "blocks freed while a payload could still land in them"
    assert worker.metrics.kv_transfers_settling._value.get() == 1
    handle.stopped.set()
    await asyncio.wait_for(release, WAIT_S)
    assert engine.free_blocks == NUM_BLOCKS
    assert worker.metrics.kv_transfers_settling._value.get() == 0


async def test_blocks_a_payload_is_still_landing_in_stay_out_of_use_until_it_ends():
    """The handle settled with ``still_landing`` (a UCX sender frozen mid-payload): the request
    ends at once, but its blocks -- and only they -- come back once that payload has ended."""
    engine = _Engine()
    other = _reserved(engine, "r0", 10)
    handle = _Handle(_reserved(engine, "r1", 100))
    handle.still_landing = asyncio.get_running_loop().create_future()
    handle.stopped.set()
    worker = _worker(engine)
    await asyncio.wait_for(release_reservation(worker, "r1", handle), WAIT_S)
    assert not engine.scheduler.kv_manager.holds("r1"), "the request did not end"
    assert engine.free_blocks == NUM_BLOCKS - len(other) - len(handle.block_ids), "freed under a landing payload"
    assert worker.metrics.kv_blocks_still_landing._value.get() == len(handle.block_ids)
    handle.still_landing.set_result(None)
    await until(lambda: engine.free_blocks == NUM_BLOCKS - len(other), "the blocks' return")
    assert worker.metrics.kv_blocks_still_landing._value.get() == 0
