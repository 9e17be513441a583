"""Shared pytest fixtures.  Each section belongs to one area; keep sections self-contained."""
from __future__ import annotations

import os
import uuid

import pytest
import redis

from common.cluster.redis_util import connect, ensure_redis, redis_url_from_env

# Workers that tests start run eagerly: compiling at every start (~10 s on 2 cores) would dominate
# the suite; tests/engine/test_compile.py covers the compiled engine, test_worker_config the default.
os.environ.setdefault("PDSERVE_COMPILE", "0")
# `make test` runs several test processes on two cores, and each starts workers: one compute
# thread per process (torch's default, a thread per core in every process, makes them contend).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tests that compile do it in their own process: a pool of compile workers (each importing torch)
# would only compete for the same two cores.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    """The longest files first, each file still whole and in order: ``make test`` hands files to
    several processes in this order, and a long file handed out last would make the run as long as
    itself after every other file has finished.  A file's length is its ``slow(seconds=N)`` mark:
    about how long it runs under ``make test`` on two cores (unmarked files are short)."""
    seconds: dict = {}
    for item in items:
        mark = item.get_closest_marker("slow")
        if mark is not None:
            seconds[item.path] = max(seconds.get(item.path, 0), mark.kwargs.get("seconds", 1))
    items.sort(key=lambda item: -seconds.get(item.path, 0))  # stable: each file keeps its order


# ---- Redis (registry, prefix index) ----------------------------------------------------------
# `redis_url`: the Redis at REDIS_URL if it answers, else a private redis-server for this session.
# `key_prefix`: a prefix unique to one test; only keys under it are deleted afterwards, so tests
# can share a real Redis with other tests and with a running deployment.


@pytest.fixture(scope="session")
def redis_url() -> str:
    url, server = ensure_redis(redis_url_from_env())
    try:
        yield url
    finally:
        if server is not None:
            server.stop()


@pytest.fixture
def key_prefix(redis_url: str) -> str:
    prefix = f"pdtest-{uuid.uuid4().hex[:12]}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        stale = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if stale:
            client.delete(*stale)
    finally:
        client.close()


@pytest.fixture
async def redis_client(redis_url: str):
    """An asyncio client from `common.cluster.redis_util.connect` (fail-fast settings, bytes replies)."""
    client = connect(redis_url)
    try:
        yield client
    finally:
        await client.aclose()


# ---- served system (integration tests) -------------------------------------------------------
# `served_checkpoint`: a tiny random Llama with a tokenizer and a chat template, on disk, shared by
# every test that starts real gateway/worker processes.


@pytest.fixture(scope="session")
def served_checkpoint(tmp_path_factory):
    from tests.support.checkpoints import tiny_llama_config, write_checkpoint, write_tokenizer

    directory = tmp_path_factory.mktemp("served") / "tinyllama"
    write_checkpoint(tiny_llama_config(), directory)
    write_tokenizer(directory)
    return directory


# ---- a small shared stack (tests of the public API) -----------------------------------------
# `small_stack`: one prefill and one decode worker (block size 16, 256 blocks, n-gram speculation
# from one-token matches up, so the decode worker verifies drafts on most streams: every test on it
# also checks that speculation changes no answer) and a gateway without API keys, started once per session.  A module that needs other gateway settings starts
# its own gateway on these pools (`tests.support.cluster.extra_gateway`).  Tests on it send prompts no
# other test sends, so they pass alone and in any order.


@pytest.fixture(scope="session")
def small_stack(served_checkpoint, redis_url, tmp_path_factory):
    from tests.support.cluster import running_cluster

    with running_cluster(served_checkpoint, tmp_path_factory.mktemp("small-stack"), redis_url, prefill=1,
                         decode=1, worker_args=["--num-blocks", "256", "--block-size", "16",
                                                "--speculative", "ngram", "--ngram-min", "1",
                                                # verify whenever a draft exists, however the loaded
                                                # machine times the steps
                                                "--no-speculative-cost-gate"],
                         # generous: on a loaded machine a lookup must not fall back to load-only routing
                         gateway_args=["--prefix-lookup-timeout", "30"]) as stack:
        assert stack.wait_for_workers(prefill=1, decode=1)
        yield stack


@pytest.fixture(scope="session")
def small_client(small_stack):
    """The official openai client on the small stack's gateway (no API key; no retries)."""
    import openai

    return openai.OpenAI(base_url=f"{small_stack.gateway_url}/v1", api_key="unused", max_retries=0, timeout=120)
