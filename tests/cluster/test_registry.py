"""Worker registry against a real Redis (the fault test uses a private redis-server it kills)."""
from __future__ import annotations

import asyncio
import time

import pytest

from common.cluster.redis_keys import RedisKeys
from common.cluster.redis_util import connect, start_redis_server
from common.cluster.registry import (Capacity, Heartbeat, KVAddress, Load, WorkerInfo, WorkerRegistry,
                             validate_worker_info)

MODEL = "org/tiny-model"


def make_info(worker_id: str, role: str = "prefill", state: str = "active", model: str = MODEL,
              **load) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id, role=role, state=state, model=model,
        http_address=f"http://10.0.0.1:{8000 + len(worker_id)}",
        kv_address=KVAddress("tcp", "10.0.0.1", 9000),
        capacity=Capacity(num_kv_blocks=1024, block_size=16, max_num_seqs=64),
        load=Load(**load), started_at=time.time(),
    )


async def test_register_get_list_roundtrip(redis_client, key_prefix):
    reg = WorkerRegistry(redis_client, key_prefix=key_prefix, ttl_s=5.0)
    written = await reg.register(make_info("p0", num_waiting=3, kv_usage=0.25))
    assert written.heartbeat_at > 0

    got = await reg.get(MODEL, "p0")
    assert got == written
    assert got.load.num_waiting == 3 and got.kv_address.transport == "tcp"
    assert await reg.list_workers(MODEL) == [written]
    assert await reg.get(MODEL, "nobody") is None

    # The entry carries the TTL, so a dead worker disappears on its own.
    pttl = await redis_client.pttl(RedisKeys(key_prefix, MODEL).worker("p0"))
    assert 0 < pttl <= 5000


async def test_list_filters_by_role_state_and_model(redis_client, key_prefix):
    reg = WorkerRegistry(redis_client, key_prefix=key_prefix)
    for info in [make_info("p1"), make_info("p0"), make_info("d0", role="decode"),
                 make_info("b0", role="both", state="draining"),
                 make_info("x0", model="other-model")]:
        await reg.register(info)

    assert [w.worker_id for w in await reg.list_workers(MODEL)] == ["b0", "d0", "p0", "p1"]
    assert [w.worker_id for w in await reg.list_workers(MODEL, roles=["prefill", "both"])] == ["b0", "p0", "p1"]
    assert [w.worker_id for w in await reg.list_workers(MODEL, states=["active"])] == ["d0", "p0", "p1"]
    assert [w.worker_id for w in await reg.list_workers("other-model")] == ["x0"]
    with pytest.raises(ValueError, match="unknown role"):
        await reg.list_workers(MODEL, roles=["prefil"])


async def test_reregister_updates_state_and_load(redis_client, key_prefix):
    reg = WorkerRegistry(redis_client, key_prefix=key_prefix)
    await reg.register(make_info("p0"))
    await reg.register(make_info("p0", state="draining", num_running=7))
    [w] = await reg.list_workers(MODEL)
    assert (w.state, w.load.num_running) == ("draining", 7)


async def test_deregister_removes_entry_index_member_and_block_set(redis_client, key_prefix):
    reg = WorkerRegistry(redis_client, key_prefix=key_prefix)
    keys = RedisKeys(key_prefix, MODEL)
    await reg.register(make_info("p0"))
    await reg.register(make_info("p1"))
    await redis_client.sadd(keys.blocks("p0"), b"\x01" * 16)

    await reg.deregister(MODEL, "p0")
    assert [w.worker_id for w in await reg.list_workers(MODEL)] == ["p1"]
    assert await redis_client.exists(keys.worker("p0"), keys.blocks("p0")) == 0
    assert await redis_client.zrange(keys.workers, 0, -1) == [b"p1"]


async def test_expired_worker_disappears_and_is_pruned(redis_client, key_prefix, monkeypatch):
    reg = WorkerRegistry(redis_client, key_prefix=key_prefix, ttl_s=0.05)
    await reg.register(make_info("p0"))
    await WorkerRegistry(redis_client, key_prefix=key_prefix, ttl_s=60).register(make_info("p1"))
    # Key expiry is Redis's clock, not something we can await: poll with a generous deadline.
    deadline = time.monotonic() + 10
    while [w.worker_id for w in await reg.list_workers(MODEL)] != ["p1"]:
        assert time.monotonic() < deadline, "expired registry entry never disappeared"
        await asyncio.sleep(0.02)
    keys = RedisKeys(key_prefix, MODEL)
    # A recently expired member stays in the index (clock-skew guard) ...
    assert sorted(await redis_client.zrange(keys.workers, 0, -1)) == [b"p0", b"p1"]
    # ... and is pruned once it is older than PRUNE_AFTER_S.
    monkeypatch.setattr(WorkerRegistry, "PRUNE_AFTER_S", -3600.0)
    assert [w.worker_id for w in await reg.list_workers(MODEL)] == ["p1"]
    assert await redis_client.zrange(keys.workers, 0, -1) == [b"p1"]


async def test_invalid_worker_info_is_rejected_naming_the_field(redis_client, key_prefix):
    reg = WorkerRegistry(redis_client, key_prefix=key_prefix)
    with pytest.raises(ValueError, match=r"kv_usage"):
        await reg.register(make_info("p0", kv_usage=1.5))
    with pytest.raises(ValueError, match=r"worker_id"):
        await reg.register(make_info("bad id with spaces"))
    with pytest.raises(ValueError, match=r"model id"):
        validate_worker_info(make_info("p0", model="has space"))
    with pytest.raises(ValueError, match="ttl_s"):
        WorkerRegistry(redis_client, key_prefix=key_prefix, ttl_s=0)
    with pytest.raises(ValueError, match="key prefix"):
        WorkerRegistry(redis_client, key_prefix="bad prefix")
    assert await reg.list_workers(MODEL) == []


async def test_unreadable_entry_is_skipped(redis_client, key_prefix):
    reg = WorkerRegistry(redis_client, key_prefix=key_prefix)
    keys = RedisKeys(key_prefix, MODEL)
    await reg.register(make_info("p0"))
    await redis_client.set(keys.worker("zz"), b'{"worker_id": "zz", "future_field": 1}', px=5000)
    await redis_client.zadd(keys.workers, {"zz": time.time() * 1000 + 5000})
    assert [w.worker_id for w in await reg.list_workers(MODEL)] == ["p0"]


async def test_heartbeat_refreshes_entry_and_deregisters_on_stop(redis_client, key_prefix):
    reg = WorkerRegistry(redis_client, key_prefix=key_prefix, ttl_s=3.0)
    beats = asyncio.Queue()
    state = {"running": 0}

    def info_fn() -> WorkerInfo:
        state["running"] += 1
        beats.put_nowait(state["running"])
        return make_info("p0", role="both", num_running=state["running"])

    hb = Heartbeat(reg, info_fn, interval_s=0.01)
    await hb.start()
    # start() validates once, writes once; then the loop keeps writing.
    while await beats.get() < 5:
        pass
    await hb.stop(deregister=False)
    [w] = await reg.list_workers(MODEL)
    assert w.load.num_running >= 3 and w == hb.last
    assert hb.failures == 0

    hb2 = Heartbeat(reg, lambda: make_info("p0", role="both"))
    await hb2.start()
    await hb2.stop()
    assert await reg.list_workers(MODEL) == []
    # A state change after the stop (a late /admin/role while the server still answers) writes nothing.
    assert await hb2.beat() is False and await reg.list_workers(MODEL) == []

    with pytest.raises(ValueError, match="interval_s"):
        Heartbeat(reg, info_fn, interval_s=3.0)


async def test_a_beat_that_read_the_old_state_never_lands_after_the_change(redis_client, key_prefix):
    """A periodic beat reads "draining", then a role change's beat reads "active": whichever write
    Redis sees last must be the newer state, however the two writes' round trips interleave."""
    reg = WorkerRegistry(redis_client, key_prefix=key_prefix, ttl_s=5.0)
    register = reg.register
    first_write_may_finish = asyncio.Event()

    async def slow_first_write(info):
        if info.state == "draining":
            await first_write_may_finish.wait()
        return await register(info)

    reg.register = slow_first_write
    state = {"now": "draining"}
    hb = Heartbeat(reg, lambda: make_info("p0", state=state["now"]))
    periodic = asyncio.create_task(hb.beat())
    await asyncio.sleep(0)  # it has read "draining" and is writing it
    state["now"] = "active"
    change = asyncio.create_task(hb.beat())
    await asyncio.sleep(0.05)
    first_write_may_finish.set()
    assert await periodic and await change
    assert (await reg.get(MODEL, "p0")).state == "active"


async def test_heartbeat_survives_redis_outage():
    server = start_redis_server()
    client = connect(server.url, timeout_s=0.5)
    try:
        reg = WorkerRegistry(client, key_prefix="pdtest-outage", ttl_s=5.0)
        hb = Heartbeat(reg, lambda: make_info("p0"))
        assert await hb.beat()
        server.kill()
        assert not await hb.beat()  # logged and counted, never raised
        assert hb.failures == 1
        await hb.stop()  # deregister fails quietly too; the entry would expire
        server.start()  # same port, empty data
        assert await reg.list_workers(MODEL) == []
        hb = Heartbeat(reg, lambda: make_info("p0"))  # (the stopped one writes no more)
        assert await hb.beat()  # a beat re-creates the entry
        assert [w.worker_id for w in await reg.list_workers(MODEL)] == ["p0"]
    finally:
        await client.aclose()
        server.stop()


async def test_a_redis_that_refuses_writes_is_still_read():
    """A Redis refusing writes (here: too few replicas; MISCONF when it cannot save, a READONLY
    replica) still lists the workers: pruning a lapsed entry is housekeeping, and its refusal made
    every listing fail -- a gateway's worker list froze as it was."""
    server = start_redis_server()
    client = connect(server.url, timeout_s=5.0)
    try:
        await WorkerRegistry(client, key_prefix="pdtest-refusing", ttl_s=60).register(make_info("p1"))
        short = WorkerRegistry(client, key_prefix="pdtest-refusing", ttl_s=0.05)
        await short.register(make_info("p0"))
        while [w.worker_id for w in await short.list_workers(MODEL)] != ["p1"]:  # (Redis's clock)
            await asyncio.sleep(0.02)
        await client.config_set("min-replicas-to-write", 1)  # writes refused: NOREPLICAS
        short.PRUNE_AFTER_S = -3600.0  # p0 is due to be pruned
        assert [w.worker_id for w in await short.list_workers(MODEL)] == ["p1"]
    finally:
        await client.aclose()
        server.stop()


async def test_entries_from_a_newer_worker_with_extra_fields_are_still_read(redis_client, key_prefix):
    """Rolling upgrades: an entry carrying a field this reader does not know must not vanish."""
    import msgspec as _msgspec

    from common.cluster.registry import WorkerRegistry as _Registry

    registry = _Registry(redis_client, key_prefix=key_prefix)
    info = _make_info_for_compat()
    await registry.register(info)
    key = registry.keys(info.model).worker(info.worker_id)
    raw = _msgspec.json.decode(await redis_client.get(key))
    raw["future_field"] = 1
    raw["load"]["future_load_field"] = 2
    await redis_client.set(key, _msgspec.json.encode(raw), px=5000)
    workers = await registry.list_workers(info.model)
    assert [w.worker_id for w in workers] == [info.worker_id]


def _make_info_for_compat():
    from common.cluster.registry import Capacity, KVAddress, WorkerInfo

    return WorkerInfo(worker_id="w-compat", role="decode", model="m", http_address="http://127.0.0.1:1",
                      kv_address=KVAddress(transport="tcp", host="127.0.0.1", port=2),
                      capacity=Capacity(num_kv_blocks=8, block_size=4, max_num_seqs=2), state="active")
