"""A worker's view of its peers (worker.peers) while Redis is unreachable: the last verified
entry of a peer serves only until that entry expires (issue 27 security review: it served forever,
so a decode worker kept sending prompts to an address its owner had long left).  Real Redis for the
entry, a Redis address nothing listens on for the outage, and clocks the test holds."""
from __future__ import annotations

import socket
import time

import pytest

from common.cluster.auth import ClusterAuth
from common.cluster.redis_util import connect
from common.cluster.registry import ENTRY_CLOCK_SKEW_S, Capacity, KVAddress, WorkerInfo, WorkerRegistry
from worker.peers import PeerDirectory

MODEL = "org/tiny-model"
SECRET = "peer-directory-test-secret-0123456789"
TTL_S = 5.0


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def entry(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="prefill", model=MODEL, http_address="http://10.0.0.1:8100",
                      kv_address=KVAddress("tcp", "10.0.0.1", 9000),
                      capacity=Capacity(num_kv_blocks=64, block_size=16, max_num_seqs=8), state="active")


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def unreachable_redis():
    client = connect(f"redis://127.0.0.1:{closed_port()}/0")
    yield client
    await client.aclose()


@pytest.fixture
def wall():
    return Clock(time.time())


@pytest.fixture
async def registry(redis_client, key_prefix, wall):
    registry = WorkerRegistry(redis_client, key_prefix=key_prefix, ttl_s=TTL_S, auth=ClusterAuth(SECRET), clock=wall)
    await registry.register(entry("p0"))
    return registry


async def test_the_last_entry_serves_during_an_outage_until_it_expires(registry, wall, unreachable_redis):
    peers = PeerDirectory(registry, MODEL, max_age_s=0.0)  # every lookup asks Redis
    known = await peers.get("p0")
    assert known is not None and known.worker_id == "p0"
    registry.client = unreachable_redis  # Redis is gone from here on
    assert await peers.get("p0") == known  # serving goes on with what was verified
    wall.now = known.expires_at + ENTRY_CLOCK_SKEW_S  # as long as any reader takes the entry
    assert await peers.get("p0") == known
    wall.now += 1  # expired for every reader: the peer counts as absent, as it would in Redis
    assert await peers.get("p0") is None
    assert await peers.get("nobody") is None


async def test_a_cached_entry_is_not_used_past_its_expiry_however_fresh_the_cache(registry, wall):
    monotonic = Clock(0.0)
    peers = PeerDirectory(registry, MODEL, max_age_s=60.0, monotonic=monotonic)
    known = await peers.get("p0")
    await registry.deregister(MODEL, "p0")
    assert await peers.get("p0") == known  # within max_age_s, from the cache
    wall.now = known.expires_at + ENTRY_CLOCK_SKEW_S + 1
    assert await peers.get("p0") is None  # the cache is young, but the entry has expired
