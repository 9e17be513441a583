"""Signed registry entries against a real Redis: whoever can write to Redis but lacks the cluster
secret cannot add, alter, move or redirect a worker, nor bring back an entry that has expired."""
from __future__ import annotations

import logging
import time

import msgspec
import pytest

from common.cluster.auth import AUTH_VERSION, ClusterAuth
from common.cluster.registry import (
    Capacity, KVAddress, WorkerInfo, WorkerRegistry, check_http_address, open_entry, seal_entry,
    validate_worker_info,
)

MODEL = "org/tiny-model"
SECRET = "registry-test-secret-0123456789"


def make_info(worker_id: str, http_address: str = "http://10.0.0.1:8100", **fields) -> WorkerInfo:
    """An entry as a current worker signs it now (``register`` stamps these fields itself)."""
    now = time.time()
    return entry_fields(worker_id, http_address, **{"heartbeat_at": now, "expires_at": now + 5,
                                                    "auth_version": AUTH_VERSION,
                                                    **fields})


def entry_fields(worker_id: str, http_address: str = "http://10.0.0.1:8100", **fields) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="prefill", model=MODEL, http_address=http_address,
                      kv_address=KVAddress("tcp", "10.0.0.1", 9000),
                      capacity=Capacity(num_kv_blocks=64, block_size=16, max_num_seqs=8), state="active",
                      **fields)


@pytest.fixture
def rejected():
    return []


@pytest.fixture
def registry(redis_client, key_prefix, rejected):
    return WorkerRegistry(redis_client, key_prefix=key_prefix, auth=ClusterAuth(SECRET), on_rejected=rejected.append)


async def write_raw(registry: WorkerRegistry, worker_id: str, raw: bytes) -> None:
    keys = registry.keys(MODEL)
    await registry.client.set(keys.worker(worker_id), raw, px=5000)
    await registry.client.zadd(keys.workers, {worker_id: time.time() * 1000 + 5000})


async def test_signed_entries_round_trip_and_stay_plain_json(registry):
    written = await registry.register(make_info("p0"))
    assert await registry.list_workers(MODEL) == [written]
    assert await registry.get(MODEL, "p0") == written
    raw = await registry.client.get(registry.keys(MODEL).worker("p0"))
    stored = msgspec.json.decode(raw)  # still one JSON object: readers without a secret still read it
    assert len(stored["signature"]) == 64 and stored["worker_id"] == "p0"
    assert await WorkerRegistry(registry.client, key_prefix=registry.key_prefix).list_workers(MODEL) == [written]


async def test_forged_tampered_and_misplaced_entries_are_ignored_and_counted(registry, rejected, caplog):
    genuine = await registry.register(make_info("p0"))
    payload = msgspec.json.encode(make_info("forged", heartbeat_at=time.time()))
    other = ClusterAuth("some-other-secret-0123456789")
    raw_p0 = await registry.client.get(registry.keys(MODEL).worker("p0"))
    with caplog.at_level(logging.WARNING, logger="common.cluster.registry"):
        await write_raw(registry, "forged", payload)                                  # unsigned
        await write_raw(registry, "forged2", seal_entry(msgspec.json.encode(make_info("forged2")), other))
        await write_raw(registry, "p1", raw_p0)                                       # p0's entry under p1
        await write_raw(registry, "p2", raw_p0.replace(b"10.0.0.1:8100", b"10.6.6.6:8100"))  # redirected
        for _ in range(3):
            assert await registry.list_workers(MODEL) == [genuine]
        assert await registry.get(MODEL, "forged") is None and await registry.get(MODEL, "p1") is None
    assert sorted(set(rejected)) == ["misplaced", "signature"]
    assert len(rejected) == 3 * 4 + 2
    # Logged once per worker id, however often the pool is read.
    warnings = [r.getMessage() for r in caplog.records]
    assert sorted(m.split("'")[1] for m in warnings) == ["forged", "forged2", "p1", "p2"]
    assert all("ignoring the registry entry" in m for m in warnings)


async def test_entries_from_a_newer_worker_still_verify(registry):
    """Rolling upgrades: a newer worker signs an entry with fields this reader does not know."""
    payload = msgspec.json.decode(msgspec.json.encode(make_info("p9")))
    payload["future_field"] = {"x": 1}
    payload["load"] = {"num_running": 2, "future_load_field": 3}
    await write_raw(registry, "p9", seal_entry(msgspec.json.encode(payload), registry.auth))
    [entry] = await registry.list_workers(MODEL)
    assert entry.worker_id == "p9" and entry.load.num_running == 2


async def test_a_signed_entry_with_a_bad_address_is_ignored(registry, rejected):
    bad = msgspec.json.encode(make_info("p3")).replace(b"http://10.0.0.1:8100", b"http://u:p@10.0.0.1:8100/x")
    await write_raw(registry, "p3", seal_entry(bad, registry.auth))
    assert await registry.list_workers(MODEL) == [] and rejected == ["address"]


@pytest.mark.parametrize("address", [
    "https://10.0.0.1:8100", "http://user:pw@10.0.0.1:8100", "http://10.0.0.1:8100/admin", "http://10.0.0.1",
    "http://10.0.0.1:8100?x=1", "http://10.0.0.1:8100#f", "http://10.0.0.1:0", "http://a b:1", "http://10.0.0.1:8100/",
    "file:///etc/passwd", "http://evil.com\\@10.0.0.1:8100",
])
def test_addresses_must_be_plain_http_host_port(address):
    with pytest.raises(ValueError, match="http_address"):
        check_http_address(address)
    with pytest.raises(ValueError, match="http_address"):
        validate_worker_info(make_info("p0", http_address=address))


def test_kv_hosts_are_plain_hosts():
    for host in ("10.0.0.1", "worker-3.example", "::1", "[fe80::1]", "pdserve_decode_1"):
        validate_worker_info(msgspec.structs.replace(make_info("p0"), kv_address=KVAddress("tcp", host, 1)))
    for host in ("a b", "10.0.0.1:9000/x", "user@host", "", "a\nb"):
        with pytest.raises(ValueError, match="host"):
            validate_worker_info(msgspec.structs.replace(make_info("p0"), kv_address=KVAddress("tcp", host, 1)))


def test_seal_and_open():
    auth = ClusterAuth(SECRET)
    payload = msgspec.json.encode(make_info("p0"))
    sealed = seal_entry(payload, auth)
    assert open_entry(sealed, auth) == payload
    assert open_entry(payload, auth) is None  # unsigned
    assert open_entry(sealed.replace(b'"prefill"', b'"decode"'), auth) is None  # altered after signing
    assert open_entry(sealed, ClusterAuth("some-other-secret-0123456789")) is None
    assert open_entry(payload, ClusterAuth.disabled()) == payload  # no secret: loopback-only deployments
    assert open_entry(sealed, ClusterAuth.disabled()) == payload
    assert seal_entry(payload, ClusterAuth.disabled()) == payload


async def test_without_a_secret_unsigned_entries_are_read(redis_client, key_prefix):
    plain = WorkerRegistry(redis_client, key_prefix=key_prefix)
    written = await plain.register(make_info("p0"))
    assert await plain.list_workers(MODEL) == [written]
    # ... but a reader with a secret ignores them.
    assert await WorkerRegistry(redis_client, key_prefix=key_prefix, auth=ClusterAuth(SECRET)).list_workers(MODEL) == []


# ---- expiry (M2): a signed entry is live only until its signed expiry ----------------------------


async def test_a_captured_entry_written_back_after_it_expired_is_ignored(registry, rejected):
    """Someone who read a worker's signed entry an hour ago writes it back into Redis, with a fresh
    Redis TTL: its signature still verifies, but it expired long ago."""
    hour_ago = time.time() - 3600
    captured = msgspec.json.decode(msgspec.json.encode(entry_fields("p0", heartbeat_at=hour_ago)))
    captured.update(expires_at=hour_ago + 5, auth_version=AUTH_VERSION)  # as the worker signed it then
    await write_raw(registry, "p0", seal_entry(msgspec.json.encode(captured), registry.auth))
    assert await registry.list_workers(MODEL) == []
    assert await registry.get(MODEL, "p0") is None
    assert rejected == ["expired", "expired"]


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


async def test_readers_enforce_the_signed_expiry_with_a_clock_skew_allowance(redis_client, key_prefix):
    """Writer and readers on clocks the test holds; the Redis TTL is long, so only the signed expiry
    decides (no race with Redis)."""
    from common.cluster.registry import ENTRY_CLOCK_SKEW_S

    t0 = time.time()
    auth = ClusterAuth(SECRET)
    writer = WorkerRegistry(redis_client, key_prefix=key_prefix, ttl_s=600, auth=auth, clock=Clock(t0))
    written = await writer.register(make_info("p0"))
    assert (written.heartbeat_at, written.expires_at, written.auth_version) == (t0, t0 + 600, AUTH_VERSION)
    rejected = []
    clock = Clock(t0)
    reader = WorkerRegistry(redis_client, key_prefix=key_prefix, auth=auth, clock=clock, on_rejected=rejected.append)
    for now, live in [(t0 - ENTRY_CLOCK_SKEW_S, True),             # the reader's clock behind by the allowance
                      (t0 + 600 + ENTRY_CLOCK_SKEW_S, True),       # past expiry, within the allowance
                      (t0 + 600 + ENTRY_CLOCK_SKEW_S + 1, False),  # expired
                      (t0 - ENTRY_CLOCK_SKEW_S - 1, False)]:       # written in the reader's future
        clock.now = now
        assert (await reader.list_workers(MODEL) == [written]) is live, now - t0
        assert (await reader.get(MODEL, "p0") == written) is live, now - t0
    assert rejected == ["expired", "expired", "clock", "clock"]
    # Without a secret the expiry holds all the same.
    plain = WorkerRegistry(redis_client, key_prefix=key_prefix, clock=Clock(t0 + 600 + ENTRY_CLOCK_SKEW_S + 1))
    assert await plain.list_workers(MODEL) == []


async def test_entries_of_an_older_auth_version_are_ignored_with_a_warning_naming_it(registry, rejected, caplog):
    """A worker of cluster auth v1 (no version, no expiry in its entry) in a v3 cluster; and one of v2
    (no instance: requests to it were signed for its id alone)."""
    v1 = msgspec.json.encode(entry_fields("old0", heartbeat_at=time.time()))  # what a v1 worker signed
    with caplog.at_level(logging.WARNING, logger="common.cluster.registry"):
        await write_raw(registry, "old0", seal_entry(v1, registry.auth))
        assert await registry.list_workers(MODEL) == []
    assert rejected == ["version"]
    assert f"speaks cluster auth v1, this process v{AUTH_VERSION}" in caplog.text
    v2 = msgspec.json.decode(msgspec.json.encode(make_info("old1")))
    del v2["instance"]
    v2["auth_version"] = 2
    with caplog.at_level(logging.WARNING, logger="common.cluster.registry"):
        await write_raw(registry, "old1", seal_entry(msgspec.json.encode(v2), registry.auth))
        assert await registry.get(MODEL, "old1") is None
    assert rejected == ["version", "version"] and "speaks cluster auth v2" in caplog.text


async def test_an_entry_names_its_run_and_callers_sign_for_it(registry, rejected):
    """``instance`` is signed with the entry; a malformed one makes the entry unreadable."""
    written = await registry.register(make_info("p0", instance="ab" * 16))
    assert written.audience == "p0/" + "ab" * 16
    assert (await registry.get(MODEL, "p0")).audience == written.audience
    assert make_info("p1").instance != make_info("p1").instance  # a fresh run unless one is given
    bad = msgspec.json.decode(msgspec.json.encode(written))
    bad["instance"] = "AB" * 16
    await write_raw(registry, "p0", seal_entry(msgspec.json.encode(bad), registry.auth))
    assert await registry.get(MODEL, "p0") is None and rejected == ["unreadable"]
