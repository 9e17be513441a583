"""A background response's run in a real Redis (gateway/response_runs.py): a streamed run's events are
kept in order, read from any sequence number, and its end appends its last ones with the stored
response in one step; nothing is appended or stored once the run no longer holds (cancelled); one
response's events are bounded, count in its API key's bytes as they are appended, and go with it
when it is deleted; events Redis did not answer for go with the next ones, once each, in order; a
reader of a run's events stops at its last event, or when the run ends without one."""
from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
import redis.asyncio as aioredis

from gateway.background_responses import BackgroundResponses
from gateway.openai_errors import OpenAIError
from gateway.openai_protocol import ChatMessage
from gateway.response_runs import RunStore
from gateway.response_store import ResponseStore, StoredResponse
from tests.support.holdable_proxy import proxied

INPUT = [ChatMessage(role="user", content="hi")]


def rid(n: int) -> str:
    return f"resp_{n:032x}"


def event(kind: str, n: int) -> bytes:
    return f'event: response.{kind}\ndata: {{"sequence_number": {n}}}\n\n'.encode()


def shell(n: int) -> StoredResponse:
    body = json.dumps({"id": rid(n), "status": "queued", "background": True}).encode()
    return StoredResponse(body, list(INPUT), 1, answered=False, running=True, streamed=True)


def ended(n: int) -> StoredResponse:
    body = json.dumps({"id": rid(n), "status": "completed", "background": True}).encode()
    return StoredResponse(body, [*INPUT, ChatMessage(role="assistant", content="hello")], 1, streamed=True)


@pytest.fixture
def store(redis_client, key_prefix):
    return ResponseStore(redis_client, key_prefix=key_prefix, max_bytes=4096, timeout_s=5.0)


async def running(store: ResponseStore, n: int) -> RunStore:
    assert await store.save("key-a", rid(n), shell(n), run_lease_s=60)
    return RunStore(store)


async def test_a_runs_events_are_kept_in_order_and_its_end_appends_its_last_with_it(store, redis_client, key_prefix):
    runs = await running(store, 1)
    deltas = [event("output_text.delta", i) for i in range(3)]
    assert await runs.append("key-a", rid(1), deltas[:2])
    assert await runs.append("key-a", rid(1), deltas[2:])
    assert await runs.events("key-a", rid(1), 0) == (deltas, True)
    assert await runs.events("key-a", rid(1), 2) == (deltas[2:], True)  # after sequence number 1
    last = event("completed", 3)
    assert await runs.finish("key-a", rid(1), ended(1), [last])
    assert await runs.events("key-a", rid(1), 0) == ([*deltas, last], False)  # ended: no more come
    loaded = await store.load("key-a", rid(1))
    assert (json.loads(loaded.response)["status"], loaded.streamed, loaded.running) == ("completed", True, False)
    size = int(await redis_client.hget(f"{key_prefix}:responses:key-a:sizes", rid(1)))
    assert size == len(msgspec.msgpack.encode(ended(1))) + sum(map(len, [*deltas, last]))  # its events count too
    assert await redis_client.ttl(store.index_key("key-a")) > store.ttl_s  # (as long as a conversation lives)
    assert await redis_client.ttl(store.sizes_key("key-a")) > store.ttl_s


async def test_nothing_is_appended_or_stored_once_a_run_is_cancelled(store, redis_client, key_prefix):
    runs = await running(store, 2)
    assert await runs.append("key-a", rid(2), [event("created", 0)])
    size = int(await redis_client.hget(f"{key_prefix}:responses:key-a:sizes", rid(2)))
    assert size == len(msgspec.msgpack.encode(shell(2))) + len(event("created", 0))  # counted as appended
    assert json.loads(await runs.cancel("key-a", rid(2)))["status"] == "cancelled"
    assert not await runs.append("key-a", rid(2), [event("in_progress", 1)])
    assert not await runs.finish("key-a", rid(2), ended(2), [event("completed", 1)])
    assert await runs.events("key-a", rid(2), 0) == ([event("created", 0)], False)
    assert json.loads((await store.load("key-a", rid(2))).response)["status"] == "cancelled"


async def test_a_responses_events_are_bounded_and_go_with_it(store, redis_client, key_prefix):
    runs = await running(store, 3)
    assert await runs.append("key-a", rid(3), [b"x" * 3000])
    assert await runs.append("key-a", rid(3), [b"x" * 2000])  # the batch that crosses 4096 bytes is kept (numbered)
    with pytest.raises(OpenAIError) as info:
        await runs.append("key-a", rid(3), [b"x"])  # past the store's 4096 bytes a response
    assert info.value.status == 500
    assert len((await runs.events("key-a", rid(3), 0))[0]) == 2
    await store.delete("key-a", rid(3))
    assert not await redis_client.exists(f"{key_prefix}:responses:key-a:{rid(3)}:events")


async def test_a_reader_stops_at_the_last_event_or_when_the_run_ends_without_one(store):
    background = BackgroundResponses(store, max_runs=8)
    runs = background.runs
    await store.save("key-a", rid(4), shell(4), run_lease_s=60)
    await runs.append("key-a", rid(4), [event("created", 0), event("output_text.delta", 1)])
    await runs.finish("key-a", rid(4), ended(4), [event("completed", 2)])
    assert await read(background.events("key-a", rid(4), 0)) == [event("output_text.delta", 1),
                                                                 event("completed", 2)]
    await store.save("key-a", rid(6), shell(6), run_lease_s=60)  # read while it runs: each event once
    await runs.append("key-a", rid(6), [event("created", 0)])
    reader = background.events("key-a", rid(6), -1)
    assert await anext(reader) == event("created", 0)
    await runs.append("key-a", rid(6), [event("output_text.delta", 1)])
    await runs.finish("key-a", rid(6), ended(6), [event("completed", 2)])
    assert await read(reader) == [event("output_text.delta", 1), event("completed", 2)]
    await store.save("key-a", rid(5), shell(5), run_lease_s=60)
    await runs.append("key-a", rid(5), [event("created", 0)])
    await runs.cancel("key-a", rid(5))
    assert await read(background.events("key-a", rid(5), -1)) == [event("created", 0)]


async def read(events) -> list[bytes]:
    async with asyncio.timeout(120):  # (a hang guard: it ends by itself)
        return [e async for e in events]


async def test_events_redis_did_not_take_go_with_the_next_once_and_in_order(redis_url, key_prefix):
    async with proxied(redis_url) as proxy:
        client = aioredis.Redis.from_url(proxy.url)
        try:
            store = ResponseStore(client, key_prefix=key_prefix, max_bytes=4096, timeout_s=0.5)
            runs = await running(store, 7)
            assert await runs.append("key-a", rid(7), [event("created", 0)])
            proxy.hold()  # Redis takes the next append (the bytes flow later), its answer does not come
            assert await runs.append("key-a", rid(7), [event("in_progress", 1)])
            proxy.release()
            assert await runs.append("key-a", rid(7), [event("output_text.delta", 2)])
            proxy.hold()  # ... and once more, before its end
            assert await runs.append("key-a", rid(7), [event("output_text.delta", 3)])
            proxy.release()
            assert await runs.finish("key-a", rid(7), ended(7), [event("completed", 4)])
            found, _ = await runs.events("key-a", rid(7), 0)
            assert found == [event("created", 0), event("in_progress", 1), event("output_text.delta", 2),
                             event("output_text.delta", 3), event("completed", 4)]
            size = int(await client.hget(f"{key_prefix}:responses:key-a:sizes", rid(7)))
            assert size == len(msgspec.msgpack.encode(ended(7))) + sum(map(len, found))  # each counted once
        finally:
            await client.aclose()


async def test_a_stopping_gateways_readers_end(store):
    background = BackgroundResponses(store, max_runs=8)
    await store.save("key-a", rid(8), shell(8), run_lease_s=3600)  # (it holds as long as the test needs)
    await background.runs.append("key-a", rid(8), [event("created", 0)])
    reader = background.events("key-a", rid(8), -1)
    assert await anext(reader) == event("created", 0)  # the run holds: the reader waits for more
    background.stopping()
    assert await read(reader) == []
