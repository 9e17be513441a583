"""Live role change under continuous load: a decode worker becomes a prefill worker and back while
streams run and new requests keep arriving.  No request fails or is cut short, and every block
pool passes its integrity check afterwards with no block leaked."""
from __future__ import annotations

import asyncio
import time

import openai
import pytest

from launcher.local_stack import LocalStack
from tests.support.cluster import ADMIN_TOKEN, http_json, running_cluster

pytestmark = pytest.mark.slow(seconds=9)  # a long file: scheduled by its length (tests/conftest.py)

TOKEN = ADMIN_TOKEN  # what tests/support/cluster.py gives the gateway
MAX_TOKENS = 24
CONCURRENCY = 8


@pytest.fixture(scope="module")
def cluster(served_checkpoint, tmp_path_factory, redis_url):
    with running_cluster(served_checkpoint, tmp_path_factory.mktemp("rolechange"), redis_url, prefill=1, decode=2,
                         worker_args=["--num-blocks", "512"]) as c:
        yield c


def admin(cluster: LocalStack, path: str, body: bytes | None = None) -> dict:
    return http_json(f"{cluster.gateway_url}{path}", "POST" if body is not None else "GET", body,
                     {"X-Admin-Token": TOKEN, "Content-Type": "application/json"})


def worker_entry(cluster: LocalStack, worker_id: str) -> dict:
    """The worker's registry entry (waiting out a heartbeat that ran late on a loaded machine)."""
    deadline = time.monotonic() + 30
    while True:
        entry = next((w for w in admin(cluster, "/admin/pools")["workers"] if w["worker_id"] == worker_id), None)
        if entry is not None or time.monotonic() > deadline:
            assert entry is not None, f"{worker_id} is not in the registry"
            return entry
        time.sleep(0.1)


class Load:
    """Streams completions through the official client, CONCURRENCY at a time, until stopped."""

    def __init__(self, cluster: LocalStack):
        self.client = openai.AsyncOpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="x", max_retries=0,
                                         timeout=120)
        self.model = cluster.model_name
        self.results: list[tuple[int, str | None, int, int]] = []  # (i, finish_reason, chunks, completion_tokens)
        self.errors: list[str] = []
        self.stop = asyncio.Event()
        self.started = 0

    async def one(self, i: int) -> None:
        # Long prompts go through the prefill pool (KV shipped), short ones are decoded locally.
        prompt = f"request {i}: " + ("the quick brown fox " * (20 if i % 3 else 2))
        finish, chunks, usage = None, 0, None
        try:
            stream = await self.client.completions.create(
                model=self.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.8, seed=i, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    chunks += 1
                    finish = choice.finish_reason or finish
        except Exception as exc:  # every failure is a test failure; keep them all for the report
            self.errors.append(f"request {i}: {type(exc).__name__}: {exc}")
            return
        self.results.append((i, finish, chunks, usage.completion_tokens if usage else -1))

    async def run(self) -> None:
        running: set[asyncio.Task] = set()
        while not self.stop.is_set():
            while len(running) < CONCURRENCY and not self.stop.is_set():
                running.add(asyncio.create_task(self.one(self.started)))
                self.started += 1
            done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.gather(*running)

    async def until(self, completed: int) -> None:
        """Wait (under load) until at least ``completed`` requests have finished."""
        while len(self.results) + len(self.errors) < completed:
            await asyncio.sleep(0.05)


async def poll(fn, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await asyncio.to_thread(fn)
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def test_decode_to_prefill_and_back_under_load(cluster):
    load = Load(cluster)
    runner = asyncio.create_task(load.run())
    try:
        # d1 must hold streams when it leaves the decode pool: the answer counts what it held at the
        # change; where its streams all ended between the poll and the change, it is taken back and
        # tried again (the gateway spreads the load, so d1 is not always decoding)
        for _ in range(20):
            await poll(lambda: cluster.stats("d1")["inflight"] > 0, "d1 to be decoding")
            answer = await asyncio.to_thread(admin, cluster, "/admin/workers/d1/role", b'{"role": "prefill"}')
            assert answer["role"] == "prefill" and answer["state"] == "active"
            if answer["inflight"] > 0:
                break
            await asyncio.to_thread(admin, cluster, "/admin/workers/d1/role", b'{"role": "decode"}')
        assert answer["inflight"] > 0, "d1 held no stream at any of 20 role changes"
        entry = await asyncio.to_thread(worker_entry, cluster, "d1")
        assert entry["role"] == "prefill"  # the registry (and the gateway's routing) has it at once
        # It keeps streaming what it had while the gateway sends new streams elsewhere.
        await load.until(len(load.results) + 3 * CONCURRENCY)
        await poll(lambda: cluster.stats("d1")["num_running"] == 0 or None, "d1's old streams to finish")

        answer = await asyncio.to_thread(admin, cluster, "/admin/workers/d1/role", b'{"role": "decode"}')
        assert answer["role"] == "decode"
        await poll(lambda: cluster.stats("d1")["num_running"] > 0, "d1 to decode again")
        await load.until(len(load.results) + 2 * CONCURRENCY)
    finally:
        load.stop.set()
        await runner
        await load.client.close()

    assert load.errors == []
    assert len(load.results) == load.started >= 5 * CONCURRENCY
    for i, finish, chunks, completion_tokens in load.results:
        assert finish == "length", f"request {i} ended with {finish}"
        assert completion_tokens == MAX_TOKENS, f"request {i}: {completion_tokens} tokens"

    # Afterwards: every request is gone from every worker, no block is held, and the pools are sound.
    for name in ("p0", "d0", "d1"):
        stats = await poll(lambda n=name: (s := cluster.worker_json(n, "/stats?check=1"))["inflight"] == 0
                           and s["num_running"] == 0 and s["num_waiting"] == 0 and s, f"{name} to go idle")
        assert stats["pool_ok"], f"{name}: {stats['pool_error']}"
        assert stats["num_free_blocks"] == stats["num_blocks"], f"{name} leaked blocks: {stats}"
    assert worker_entry(cluster, "d1")["role"] == "decode"
