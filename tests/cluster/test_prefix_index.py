"""Prefix-cache index against a real Redis, including Redis crashing and coming back empty."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from common.engine.kv.prefix_hash import HASH_LEN, hash_prompt_blocks
from common.cluster.prefix_index import PrefixIndexPublisher, PrefixIndexReader
from common.cluster.redis_keys import RedisKeys
from common.cluster.redis_util import connect, start_redis_server

MODEL = "org/tiny-model"
BS = 4


def prompt_hashes(n_blocks: int, seed: int = 0) -> list[bytes]:
    tokens = [(seed * 7919 + i) % 5000 for i in range(n_blocks * BS + 2)]
    return hash_prompt_blocks(tokens, BS)


def make_publisher(client, key_prefix, worker_id, **kw) -> PrefixIndexPublisher:
    return PrefixIndexPublisher(client, model=MODEL, worker_id=worker_id, key_prefix=key_prefix, **kw)


async def test_longest_prefix_counts_leading_blocks_per_worker(redis_client, key_prefix):
    h = prompt_hashes(8)
    full = make_publisher(redis_client, key_prefix, "p-full")
    half = make_publisher(redis_client, key_prefix, "p-half")
    holes = make_publisher(redis_client, key_prefix, "p-holes")
    full.publish(h)
    half.publish(h[:4])
    holes.publish([h[0], h[1], h[3], h[4]])  # block 2 evicted: later blocks are useless
    for pub in (full, half, holes):
        assert await pub.flush()

    reader = PrefixIndexReader(redis_client, key_prefix=key_prefix)
    got = await reader.longest_prefix(MODEL, h, ["p-full", "p-half", "p-holes", "p-none", "p-full"])
    assert got == {"p-full": 8, "p-half": 4, "p-holes": 2, "p-none": 0}
    assert await reader.longest_prefix(MODEL, h[:3], ["p-half"]) == {"p-half": 3}
    assert await reader.longest_prefix(MODEL, [], ["p-half"]) == {"p-half": 0}
    assert await reader.longest_prefix(MODEL, h, []) == {}
    # Another model never sees these entries.
    assert await reader.longest_prefix("other-model", h, ["p-full"]) == {"p-full": 0}
    assert reader.available and reader.unavailable_total == 0


async def test_longest_prefix_spans_many_chunks(redis_client, key_prefix):
    h = prompt_hashes(9000)  # more than one SMISMEMBER chunk per worker
    pub = make_publisher(redis_client, key_prefix, "p0")
    pub.publish(h[:8500])
    assert await pub.flush()
    # A lookup this large may take longer than a router's bound on a loaded machine: this test is
    # about the chunks, not the time (at the default bound CI once saw {}: "Redis too slow").
    reader = PrefixIndexReader(redis_client, key_prefix=key_prefix, timeout_s=60)
    assert await reader.longest_prefix(MODEL, h, ["p0", "p1"]) == {"p0": 8500, "p1": 0}


async def test_remove_is_counted_per_block_and_ttl_is_set(redis_client, key_prefix):
    h = prompt_hashes(4)
    pub = make_publisher(redis_client, key_prefix, "p0", ttl_s=7.0)
    reader = PrefixIndexReader(redis_client, key_prefix=key_prefix)
    pub.publish(h)
    pub.publish(h[2:3])  # a second cached block with the same hash
    assert await pub.flush()
    pub.remove(h[2:])
    pub.remove([b"\xee" * HASH_LEN])  # never published: ignored
    assert await pub.flush()
    assert await reader.longest_prefix(MODEL, h, ["p0"]) == {"p0": 3}  # h[2] still held once
    pub.remove(h[2:3])
    assert await pub.flush()
    assert await reader.longest_prefix(MODEL, h, ["p0"]) == {"p0": 2}
    assert pub.num_cached == 2
    key = RedisKeys(key_prefix, MODEL).blocks("p0")
    assert 0 < await redis_client.pttl(key) <= 7000
    # Add-then-remove before a flush nets out to nothing.
    pub.publish(h[3:])
    pub.remove(h[3:])
    assert await pub.flush()
    assert await redis_client.scard(key) == 2

    await pub.stop(delete=True)
    assert await redis_client.exists(key) == 0


async def test_first_flush_replaces_a_previous_incarnations_set(redis_client, key_prefix):
    key = RedisKeys(key_prefix, MODEL).blocks("p0")
    stale = prompt_hashes(3, seed=1)
    await redis_client.sadd(key, *stale)
    pub = make_publisher(redis_client, key_prefix, "p0")
    fresh = prompt_hashes(2, seed=2)
    pub.publish(fresh)
    assert await pub.flush()
    assert set(await redis_client.smembers(key)) == set(fresh)
    assert pub.resyncs == 1


async def test_background_task_flushes_updates_from_other_threads(redis_client, key_prefix):
    h = prompt_hashes(6)
    pub = make_publisher(redis_client, key_prefix, "p0")
    reader = PrefixIndexReader(redis_client, key_prefix=key_prefix)
    flushed = asyncio.Event()
    real_flush = pub.flush

    async def observed_flush() -> bool:
        ok = await real_flush()
        flushed.set()
        return ok

    pub.flush = observed_flush  # the background loop calls self.flush()
    await pub.start()
    try:
        # The engine may run in another thread: publish() must wake the loop from there.
        await asyncio.get_running_loop().run_in_executor(None, pub.publish, h)

        async def until_published() -> None:
            while (await reader.longest_prefix(MODEL, h, ["p0"]))["p0"] != 6:
                flushed.clear()
                await flushed.wait()

        await asyncio.wait_for(until_published(), 10)
    finally:
        await pub.stop()
    assert await redis_client.exists(RedisKeys(key_prefix, MODEL).blocks("p0")) == 0


async def test_overflowing_the_queue_drops_updates_then_resyncs(redis_client, key_prefix):
    h = prompt_hashes(10)
    pub = make_publisher(redis_client, key_prefix, "p0", max_pending=4)
    assert await pub.flush()  # initial resync of an empty set
    pub.publish(h)
    assert pub.dropped_updates > 0
    assert await pub.flush()
    reader = PrefixIndexReader(redis_client, key_prefix=key_prefix)
    assert await reader.longest_prefix(MODEL, h, ["p0"]) == {"p0": 10}
    assert pub.resyncs == 2


async def test_bad_input_is_rejected(redis_client, key_prefix):
    pub = make_publisher(redis_client, key_prefix, "p0")
    with pytest.raises(ValueError, match=f"{HASH_LEN} bytes"):
        pub.publish([b"short"])
    with pytest.raises(ValueError, match=f"{HASH_LEN} bytes"):
        pub.remove(["0" * HASH_LEN])
    with pytest.raises(ValueError, match="worker_id"):
        make_publisher(redis_client, key_prefix, "bad id")
    with pytest.raises(ValueError, match="ttl_s"):
        make_publisher(redis_client, key_prefix, "p0", ttl_s=0)
    reader = PrefixIndexReader(redis_client, key_prefix=key_prefix)
    with pytest.raises(ValueError, match=f"{HASH_LEN} bytes"):
        await reader.longest_prefix(MODEL, [b"x"], ["p0"])


# ---- Redis going away ---------------------------------------------------------------------------


@pytest.fixture
def private_redis():
    server = start_redis_server()
    try:
        yield server
    finally:
        server.stop()


async def test_redis_crash_degrades_then_refills(private_redis):
    client = connect(private_redis.url, timeout_s=0.5)
    outages = []
    h = prompt_hashes(8)
    pub = PrefixIndexPublisher(client, model=MODEL, worker_id="p0", key_prefix="pdtest-crash")
    now = [0.0]
    reader = PrefixIndexReader(client, key_prefix="pdtest-crash", on_unavailable=lambda: outages.append(1),
                               clock=lambda: now[0])
    try:
        pub.publish(h[:4])
        assert await pub.flush()
        assert await reader.longest_prefix(MODEL, h, ["p0"]) == {"p0": 4}

        private_redis.kill()
        # The engine keeps committing and evicting while Redis is down: never raises, never blocks.
        pub.publish(h[4:])
        pub.remove(h[:1])
        pub.publish(h[:1])
        assert not await pub.flush()
        assert not pub.healthy and pub.flush_failures == 1
        # The gateway gets no match at all and is told why.
        assert await reader.longest_prefix(MODEL, h, ["p0"]) == {}
        assert not reader.available and reader.unavailable_total == 1 and outages == [1]

        private_redis.start()  # same port, all data lost
        now[0] += reader.retry_interval_s  # the next lookup probes Redis again
        assert await reader.longest_prefix(MODEL, h, ["p0"]) == {"p0": 0}
        assert reader.available
        assert await pub.flush()  # resync: the whole cached set, including what Redis missed
        assert pub.healthy
        assert await reader.longest_prefix(MODEL, h, ["p0"]) == {"p0": 8}
    finally:
        await pub.stop(delete=False)
        await client.aclose()


async def test_silent_restart_is_detected_by_the_next_flush(private_redis):
    client = connect(private_redis.url, timeout_s=0.5)
    h = prompt_hashes(6)
    pub = PrefixIndexPublisher(client, model=MODEL, worker_id="p0", key_prefix="pdtest-silent")
    reader = PrefixIndexReader(client, key_prefix="pdtest-silent")
    try:
        pub.publish(h[:5])
        assert await pub.flush()
        resyncs = pub.resyncs
        private_redis.kill()
        private_redis.start()  # no failed call in between: the publisher never saw an error
        pub.publish(h[5:])
        # The flush (or a keepalive) finds the set smaller than expected and republishes it.
        assert await pub.flush()
        assert pub.resyncs == resyncs + 1
        assert await reader.longest_prefix(MODEL, h, ["p0"]) == {"p0": 6}
    finally:
        await pub.stop(delete=False)
        await client.aclose()


async def test_unresponsive_redis_costs_one_timeout_then_is_skipped_until_it_answers(private_redis):
    # A Redis that accepts and never answers (SIGSTOP).  The lookup timeout is generous while Redis
    # is healthy and short while it is stopped: only its cost changes, not what the test checks.
    client = connect(private_redis.url, timeout_s=60.0)
    now = [0.0]
    reader = PrefixIndexReader(client, key_prefix="pdtest-hang", timeout_s=30.0, retry_interval_s=5.0,
                               clock=lambda: now[0])
    h = prompt_hashes(2)
    try:
        assert await reader.longest_prefix(MODEL, h, ["p0"]) == {"p0": 0}
        os.kill(private_redis.proc.pid, signal.SIGSTOP)
        try:
            reader.timeout_s = 0.5
            assert await reader.longest_prefix(MODEL, h, ["p0"]) == {}  # one bounded timeout
            assert not reader.available and reader.unavailable_total == 1
            # The breaker is open: lookups skip Redis at once, none waits for it.
            for _ in range(5):
                assert await reader.longest_prefix(MODEL, h, ["p0"]) == {}
            assert reader.skipped_total == 5 and reader.unavailable_total == 1
            # After the retry interval one lookup probes (and times out); lookups meanwhile skip.
            now[0] += 5.0
            probe = asyncio.create_task(reader.longest_prefix(MODEL, h, ["p0"]))
            await asyncio.sleep(0)
            assert await reader.longest_prefix(MODEL, h, ["p0"]) == {} and reader.skipped_total == 6
            assert await probe == {} and reader.unavailable_total == 2
            assert await reader.longest_prefix(MODEL, h, ["p0"]) == {} and reader.skipped_total == 7
        finally:
            os.kill(private_redis.proc.pid, signal.SIGCONT)
        reader.timeout_s = 30.0
        # Redis answers again: the next probe closes the breaker.
        assert await reader.longest_prefix(MODEL, h, ["p0"]) == {}  # still inside the interval
        now[0] += 5.0
        assert await reader.longest_prefix(MODEL, h, ["p0"]) == {"p0": 0}
        assert reader.available
        assert await reader.longest_prefix(MODEL, h, ["p0"]) == {"p0": 0}
    finally:
        await client.aclose()
