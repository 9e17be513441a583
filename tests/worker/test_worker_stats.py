"""/stats, /metrics and the heartbeat read the snapshot the engine thread publishes after each step;
nothing on the event loop iterates the scheduler's queues while the engine thread changes them
(that failed /metrics with "dictionary changed size during iteration" and skipped heartbeats).

A real worker runs in this process, so the scheduler's queues can be swapped for ones that note
every iteration from a thread other than the engine's; then /stats, /metrics and the registry
entry are hammered while requests stream through the engine.
"""
from __future__ import annotations

import asyncio
import threading
import traceback
from collections import deque

import aiohttp
import pytest

from common.engine.config import EngineConfig
from worker.config import WorkerConfig
from worker.lifecycle import Worker
from decode_svc.role import DECODE
from kvtransfer.config import KVTransferConfig

WAIT = 120.0


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The engine thread computes next to the event loop in this process: on a shared 2-core host
    more torch threads only fight over the cores (and the GIL)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
MAX_TOKENS = 12


class Witness:
    """Notes where the scheduler's containers are iterated from outside the engine thread."""

    def __init__(self):
        self.violations: list[str] = []

    def check(self, what: str) -> None:
        if threading.current_thread().name != "engine":
            self.violations.append(f"{what} iterated on {threading.current_thread().name}:\n"
                                   + "".join(traceback.format_stack(limit=6)))

    def guard(self, scheduler) -> None:
        """Engine thread: replace the queues by watched copies (same contents)."""
        witness = self

        class WatchedDict(dict):
            def __iter__(self):
                witness.check("scheduler dict")
                return super().__iter__()

            def values(self):
                witness.check("scheduler dict")
                return super().values()

            def items(self):
                witness.check("scheduler dict")
                return super().items()

        class WatchedDeque(deque):
            def __iter__(self):
                witness.check("scheduler queue")
                return super().__iter__()

        class WatchedList(list):
            def __iter__(self):
                witness.check("running list")
                return super().__iter__()

        scheduler.requests = WatchedDict(scheduler.requests)
        scheduler.waiting = WatchedDeque(scheduler.waiting)
        scheduler.running = WatchedList(scheduler.running)
        scheduler.landed = WatchedDeque(scheduler.landed)
        decode = scheduler.handoff.decode  # the remote-KV hand-off's reservations and leases
        decode.reservations = WatchedDict(decode.reservations)
        decode.leases = WatchedDict(decode.leases)


@pytest.fixture
async def worker(served_checkpoint, redis_url, key_prefix):
    config = WorkerConfig(
        engine=EngineConfig(model=str(served_checkpoint), num_blocks=64, block_size=4, max_num_seqs=4,
                            max_num_batched_tokens=32),
        kv=KVTransferConfig(transport="tcp"), role="decode", redis_url=redis_url, key_prefix=key_prefix)
    worker = Worker(config, [DECODE])
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()


async def test_stats_and_metrics_never_read_the_scheduler_from_the_event_loop(worker):
    witness = Witness()
    await worker.engine_thread.call(lambda engine: witness.guard(engine.scheduler))

    async def one(i: int) -> int:
        rid = f"s{i}"
        stream = worker.engine_thread.open_stream(rid)
        try:
            await worker.engine_thread.call(lambda e: e.add_request(
                [5 + i % 7] * (3 + i % 9), {"max_tokens": MAX_TOKENS, "ignore_eos": True}, rid))
            n = 0
            while True:
                output = await asyncio.wait_for(stream.get(), WAIT)
                n += len(output.new_token_ids)
                if output.finished:
                    return n
        finally:
            worker.engine_thread.close_stream(rid)

    done = asyncio.Event()
    statuses: list[int] = []
    seen_running = 0

    async def hammer(session: aiohttp.ClientSession) -> None:
        nonlocal seen_running
        while not done.is_set():
            for path in ("/stats", "/metrics"):
                async with session.get(worker.http_url + path) as resp:
                    statuses.append(resp.status)
                    if path == "/stats" and resp.status == 200:
                        stats = await resp.json()
                        assert 0 <= stats["num_running"] <= 4 and stats["num_free_blocks"] <= stats["num_blocks"]
                        seen_running = max(seen_running, stats["num_running"])
            info = worker.info()  # what the heartbeat writes
            assert info.load.num_running <= 4
            await asyncio.sleep(0.005)  # leave the engine thread some of the GIL

    async with aiohttp.ClientSession() as session:
        hammers = [asyncio.ensure_future(hammer(session)) for _ in range(2)]
        try:
            counts = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(16))), WAIT)
        finally:
            done.set()
            await asyncio.gather(*hammers)
    assert counts == [MAX_TOKENS] * 16
    assert statuses and set(statuses) == {200}
    assert seen_running > 0  # the snapshots moved with the engine
    assert not witness.violations, witness.violations[0]
    async with asyncio.timeout(WAIT):  # the snapshot after the last step
        while (stats := worker.stats())["num_running"]:
            await asyncio.sleep(0.01)
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_metrics_show_the_core_turns(tmp_path):
    from common.engine.core_turns import CoreTurns
    from worker.metrics import WorkerMetrics

    turns, metrics = CoreTurns(tmp_path / "turns.lock"), WorkerMetrics()
    for _ in range(3):
        with turns.turn():
            pass
    metrics.observe_core_turns(turns)
    text = metrics.render().decode()
    assert "pdserve_worker_core_turns 3.0" in text and "pdserve_worker_core_turns_missed 0.0" in text
    assert "pdserve_worker_core_turn_wait_seconds" in text


async def test_the_grammar_backend_is_built_before_the_worker_serves(worker):
    """(Built at the first grammar, it held the GIL for seconds: streams and the heartbeat stalled.)"""
    assert worker.engine.grammars.backend_ready
