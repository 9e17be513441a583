"""The Responses API's store over a real Redis (gateway/response_store.py): what is saved is loaded
back as it was, only by its API key; a key's oldest go past its bounds (count and bytes); a stored
response stays stored when forgetting the oldest fails; what is too large, unreadable or malformed is
absent, no id echoed; a Redis that does not answer costs the store's timeout (a read: 503; a write:
not stored, counted)."""
from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
import redis.exceptions

from gateway.openai_errors import OpenAIError
from gateway.openai_protocol import ChatMessage
from gateway.response_store import ResponseStore, StoredResponse

CONVERSATION = [ChatMessage(role="user", content="hi"), ChatMessage(role="assistant", content="hello")]


def rid(n: int) -> str:
    return f"resp_{n:032x}"


def make_store(redis_client, key_prefix, **kwargs) -> ResponseStore:
    return ResponseStore(redis_client, key_prefix=key_prefix, **{"max_bytes": 1 << 20, "timeout_s": 5.0, **kwargs})


async def not_found(call, status: int = 404) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        await call
    assert info.value.status == status
    return info.value


async def test_a_saved_response_is_loaded_back_by_its_key_alone(redis_client, key_prefix):
    store = make_store(redis_client, key_prefix, ttl_s=600, conversation_ttl_s=7200)
    assert await store.save("key-a", rid(1), StoredResponse(b'{"id": "x"}', CONVERSATION))
    loaded = await store.load("key-a", rid(1))
    assert (loaded.response, loaded.messages) == (b'{"id": "x"}', CONVERSATION)
    assert 590 <= await redis_client.ttl(f"{key_prefix}:responses:key-a:{rid(1)}") <= 600
    for counting in (store.index_key("key-a"), store.sizes_key("key-a")):  # (as long as a conversation lives)
        assert 7190 <= await redis_client.ttl(counting) <= 7200
    await not_found(store.load("key-b", rid(1)))  # another API key's
    await not_found(store.delete("key-b", rid(1)))
    assert (await store.load("key-a", rid(1))).messages == CONVERSATION


async def test_a_missing_response_continued_is_a_400_naming_the_field(redis_client, key_prefix):
    store = make_store(redis_client, key_prefix)
    error = await not_found(store.load("key-a", rid(7), param="previous_response_id"), 400)
    assert (error.param, error.code) == ("previous_response_id", "previous_response_not_found")
    for malformed in ("resp_1", "x" * 64, f"{rid(1)}:other", "*"):
        assert malformed not in (await not_found(store.load("key-a", malformed))).message  # nothing echoed


async def test_a_keys_oldest_responses_go_past_its_bound(redis_client, key_prefix):
    store = make_store(redis_client, key_prefix, max_per_key=3)
    for n in range(5):
        assert await store.save("key-a", rid(n), StoredResponse(b"{}", []))
        await asyncio.sleep(0.002)  # scores are times: distinct
    assert await store.save("key-b", rid(9), StoredResponse(b"{}", []))
    for n in (0, 1):
        await not_found(store.load("key-a", rid(n)))
    for n in (2, 3, 4):
        assert (await store.load("key-a", rid(n))).response == b"{}"
    assert await redis_client.zcard(f"{key_prefix}:responses:key-a") == 3
    assert (await store.load("key-b", rid(9))).response == b"{}"  # another key's bound is its own


async def test_a_keys_oldest_responses_go_past_its_bytes(redis_client, key_prefix):
    big = StoredResponse(b"x" * 400, [])
    store = make_store(redis_client, key_prefix, max_bytes_per_key=1000)
    for n in range(4):
        assert await store.save("key-a", rid(n), big)
        await asyncio.sleep(0.002)
    for n in (0, 1):
        await not_found(store.load("key-a", rid(n)))
    assert [(await store.load("key-a", rid(n))).response for n in (2, 3)] == [big.response] * 2
    assert await redis_client.hlen(f"{key_prefix}:responses:key-a:sizes") == 2
    # one response is never larger than a key's whole budget
    assert not await store.save("key-a", rid(9), StoredResponse(b"x" * 1100, []))


async def test_a_stored_response_stays_stored_when_forgetting_the_oldest_fails(redis_client, key_prefix):
    class FailsAfterTheWrite:  # the real client, but the eviction after the write refuses
        def pipeline(self, **kwargs):
            return redis_client.pipeline(**kwargs)

        def register_script(self, source):
            async def refused(**kwargs):
                raise redis.exceptions.ConnectionError("gone")
            return refused

    failures = []
    store = make_store(FailsAfterTheWrite(), key_prefix, max_per_key=1, on_failure=lambda: failures.append(1))
    assert await store.save("key-a", rid(1), StoredResponse(b"{}", []))
    assert await store.save("key-a", rid(2), StoredResponse(b"{}", []))  # stored; its oldest not forgotten
    assert failures == [1]
    assert (await make_store(redis_client, key_prefix).load("key-a", rid(2))).response == b"{}"


async def test_a_deleted_response_is_gone(redis_client, key_prefix):
    store = make_store(redis_client, key_prefix)
    await store.save("key-a", rid(1), StoredResponse(b"{}", CONVERSATION))
    await store.delete("key-a", rid(1))
    await not_found(store.load("key-a", rid(1)))
    await not_found(store.delete("key-a", rid(1)))
    assert await redis_client.zcard(f"{key_prefix}:responses:key-a") == 0


async def test_what_is_too_large_is_not_stored_and_what_is_unreadable_is_absent(redis_client, key_prefix):
    store = make_store(redis_client, key_prefix, max_bytes=1000)
    assert not await store.save("key-a", rid(1), StoredResponse(b"{}", [ChatMessage(role="user", content="x" * 1000)]))
    await not_found(store.load("key-a", rid(1)))
    assert await redis_client.exists(f"{key_prefix}:responses:key-a:{rid(1)}") == 0
    await redis_client.set(f"{key_prefix}:responses:key-a:{rid(2)}", b"\x93not msgpack")
    await not_found(store.load("key-a", rid(2)))


async def test_a_redis_that_does_not_answer_costs_the_timeout(key_prefix):
    async def silent(reader, writer):  # accepts and reads, never answers
        await reader.read()
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=None)  # would wait forever itself
    failures = []
    store = ResponseStore(client, key_prefix=key_prefix, max_bytes=1 << 20, timeout_s=0.3,
                          on_failure=lambda: failures.append(1))
    try:
        async with asyncio.timeout(60):  # each call is bounded by the store's own timeout alone
            assert not await store.save("key-a", rid(1), StoredResponse(b"{}", []))
            assert (await not_found(store.load("key-a", rid(1)), 503)).retry_after
            await not_found(store.delete("key-a", rid(1)), 503)
        assert len(failures) == 3
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


async def test_after_a_failure_redis_is_not_asked_again_for_a_while(key_prefix):
    connections = []

    async def silent(reader, writer):
        connections.append(1)
        await reader.read()
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    client = aioredis.Redis(host="127.0.0.1", port=server.sockets[0].getsockname()[1], socket_timeout=None)
    failures = []
    store = ResponseStore(client, key_prefix=key_prefix, max_bytes=1 << 20, timeout_s=0.3, retry_s=3600,
                          on_failure=lambda: failures.append(1))
    try:
        async with asyncio.timeout(60):
            assert not await store.save("key-a", rid(1), StoredResponse(b"{}", []))  # the one that waits
            for _ in range(3):
                assert not await store.save("key-a", rid(2), StoredResponse(b"{}", []))
                await not_found(store.load("key-a", rid(1)), 503)
                await not_found(store.delete("key-a", rid(1)), 503)
        assert (len(connections), len(failures)) == (1, 1)  # asked once; the rest answered without it
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


def test_its_bounds_are_positive():
    for bad in ({"ttl_s": 0}, {"ttl_s": float("nan")}, {"ttl_s": float("inf")}, {"conversation_ttl_s": 0},
                {"conversation_ttl_s": float("nan")}, {"conversation_ttl_s": 400 * 86400}, {"max_per_key": 0},
                {"max_bytes_per_key": 0}, {"max_bytes": 0}, {"timeout_s": 0}, {"timeout_s": float("inf")},
                {"retry_s": -1}):
        with pytest.raises(ValueError):
            ResponseStore(None, key_prefix="p", **{"max_bytes": 1, "timeout_s": 1.0, **bad})
