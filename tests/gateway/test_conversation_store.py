"""Conversations in a real Redis (gateway/conversation_store.py, gateway/conversation_items.py): made with items
and metadata, read, changed and deleted by their API key only; items added in order and at once, listed by id
(a page read again where a deletion raced it), deleted one by one with the conversation's bytes; a
conversation's bounds on items and bytes refuse what would pass them and add nothing; nothing is added to a
conversation deleted meanwhile; conversations count in their key's bounds beside its stored responses, the
least recently written forgotten first, with all their keys -- never one written after the bounds were read;
its bytes are its items' and metadata's, each change renews it; a response that would not fit is refused
before it is generated. (The items themselves: tests/gateway/test_conversation_items.py.)"""
from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from gateway.conversation_items import history, new_items
from gateway.conversation_store import ConversationStore, Held
from gateway.openai_errors import OpenAIError
from gateway.openai_protocol import ChatMessage
from gateway.response_store import ResponseStore, StoredResponse


def raw(value) -> msgspec.Raw:
    return msgspec.Raw(json.dumps(value).encode())


def said(text: str, role: str = "user") -> dict:
    return {"role": role, "content": text}


@pytest.fixture
def responses(redis_client, key_prefix):
    return ResponseStore(redis_client, key_prefix=key_prefix, max_bytes=4096, max_per_key=3, timeout_s=5.0)


@pytest.fixture
def conversations(responses):
    return ConversationStore(responses)


async def texts(conversations, key_id: str, conversation_id: str) -> list[str]:
    return [m.text() for m in history((await conversations.items(key_id, conversation_id)).items)]


async def status_of(call) -> tuple[int, str | None]:
    with pytest.raises(OpenAIError) as info:
        await call
    return info.value.status, info.value.param


async def test_a_conversation_keeps_its_items_in_order_and_its_metadata(conversations):
    made = await conversations.create("key-a", {"topic": "x"}, new_items(raw([said("one"), said("two")])))
    assert made.id.startswith("conv_") and made.metadata == {"topic": "x"}
    assert await conversations.retrieve("key-a", made.id) == made
    await conversations.append("key-a", made.id, new_items(raw([said("three", "assistant")])))
    assert await texts(conversations, "key-a", made.id) == ["one", "two", "three"]
    updated = await conversations.update("key-a", made.id, {"topic": "y"})
    assert (updated.metadata, updated.created_at) == ({"topic": "y"}, made.created_at)
    assert (await conversations.retrieve("key-a", made.id)).metadata == {"topic": "y"}


async def test_another_key_sees_and_changes_none_of_it(conversations):
    made = await conversations.create("key-a", {}, new_items(raw([said("mine")])))
    for call in (conversations.retrieve("key-b", made.id), conversations.items("key-b", made.id),
                 conversations.append("key-b", made.id, new_items(raw([said("theirs")]))),
                 conversations.update("key-b", made.id, {"a": "b"}), conversations.delete("key-b", made.id)):
        assert (await status_of(call))[0] == 404
    assert await texts(conversations, "key-a", made.id) == ["mine"]


async def test_items_are_read_by_id_and_deleted_one_by_one_with_their_bytes(conversations, responses, redis_client):
    made = await conversations.create("key-a", {}, new_items(raw([said("a"), said("b"), said("c")])))
    ids = await conversations.item_ids("key-a", made.id)
    assert len(ids) == 3 and all(i.startswith("msg_") for i in ids)
    assert json.loads(await conversations.item("key-a", made.id, ids[1]))["content"][0]["text"] == "b"
    sizes = responses.sizes_key("key-a")
    before = int(await redis_client.hget(sizes, made.id))
    assert await conversations.delete_item("key-a", made.id, ids[1]) == made
    assert await texts(conversations, "key-a", made.id) == ["a", "c"]
    assert await conversations.item_ids("key-a", made.id) == [ids[0], ids[2]]
    assert int(await redis_client.hget(sizes, made.id)) < before
    assert await status_of(conversations.item("key-a", made.id, ids[1])) == (404, "item_id")
    assert await status_of(conversations.delete_item("key-a", made.id, ids[1])) == (404, "item_id")
    assert [json.loads(i)["id"] for i in await conversations.items_by_id("key-a", made.id, ids)] == [ids[0], ids[2]]



async def test_a_page_is_read_again_where_one_of_its_items_was_deleted_between_its_reads(conversations):
    made = await conversations.create("key-a", {}, new_items(raw([said(t) for t in "abcd"])))
    ids = await conversations.item_ids("key-a", made.id)
    read_by_id = conversations.items_by_id

    async def deleted_meanwhile(key_id, conversation_id, item_ids):  # (the first read only)
        conversations.items_by_id = read_by_id
        await conversations.delete_item(key_id, conversation_id, ids[1])
        return await read_by_id(key_id, conversation_id, item_ids)

    conversations.items_by_id = deleted_meanwhile
    found, more = await conversations.page("key-a", made.id, lambda listed: (listed[:3], len(listed) > 3))
    assert [json.loads(i)["id"] for i in found] == [ids[0], ids[2], ids[3]] and not more

async def test_a_deleted_conversation_is_gone_with_its_items_and_takes_none_after(conversations, redis_client):
    made = await conversations.create("key-a", {}, new_items(raw([said("a")])))
    await conversations.delete("key-a", made.id)
    assert [k async for k in redis_client.scan_iter(match=f"*{made.id}*")] == []
    assert await status_of(conversations.append("key-a", made.id, new_items(raw([said("b")])), "conversation")) == (
        404, "conversation")
    assert not await redis_client.exists(*conversations.keys("key-a", made.id))  # nothing made again
    assert (await status_of(conversations.delete("key-a", made.id)))[0] == 404


async def test_items_past_a_conversations_bytes_are_refused_and_none_of_them_added(conversations):
    made = await conversations.create("key-a", {}, new_items(raw([said("a")])))
    too_many = new_items(raw([said("x" * 1000)] * 5))  # 5 kB against the store's 4096 bytes
    assert await status_of(conversations.append("key-a", made.id, too_many)) == (400, "items")
    assert await texts(conversations, "key-a", made.id) == ["a"]
    assert (await status_of(conversations.create("key-a", {}, too_many)))[0] == 400


async def test_items_past_a_conversations_count_are_refused(conversations, monkeypatch):
    monkeypatch.setattr("gateway.conversation_store.MAX_ITEMS", 3)
    made = await conversations.create("key-a", {}, new_items(raw([said("a"), said("b")])))
    assert await status_of(conversations.append("key-a", made.id, new_items(raw([said("c"), said("d")])))) == (
        400, "items")
    await conversations.append("key-a", made.id, new_items(raw([said("c")])))
    assert await texts(conversations, "key-a", made.id) == ["a", "b", "c"]


async def test_two_responses_ending_together_add_their_items_each_at_once(conversations):
    made = await conversations.create("key-a", {}, [])
    turns = [new_items(raw([said(f"{n}-{i}") for i in range(10)])) for n in range(2)]
    await asyncio.gather(*(conversations.append("key-a", made.id, t) for t in turns))
    got = await texts(conversations, "key-a", made.id)
    assert sorted([got[:10], got[10:]]) == [[f"{n}-{i}" for i in range(10)] for n in range(2)]


async def test_conversations_count_in_their_keys_bounds_the_least_recently_written_forgotten(
        conversations, responses, redis_client):
    # max_per_key 3: a stored response, then three conversations; the first conversation written
    # again is kept, the response (the oldest write) and then the second conversation go.
    await responses.save("key-a", f"resp_{1:032x}", StoredResponse(b"{}", [ChatMessage(role="user", content="x")]))
    first = await conversations.create("key-a", {}, [])
    second = await conversations.create("key-a", {}, new_items(raw([said("b")])))
    await conversations.append("key-a", first.id, new_items(raw([said("a")])))
    await conversations.create("key-a", {}, [])
    assert (await status_of(responses.load("key-a", f"resp_{1:032x}")))[0] == 404
    await conversations.create("key-a", {}, [])
    assert await texts(conversations, "key-a", first.id) == ["a"]
    assert (await status_of(conversations.retrieve("key-a", second.id)))[0] == 404
    assert [k async for k in redis_client.scan_iter(match=f"*{second.id}*")] == []  # none of its keys left


async def test_a_conversation_written_after_its_keys_bounds_were_read_is_not_forgotten(
        conversations, responses, redis_client):
    # The bounds are read (the conversation is the key's oldest), then it is written, then the
    # oldest are forgotten: the write wins.
    active = await conversations.create("key-a", {}, [])
    index = await redis_client.zrange(responses.index_key("key-a"), 0, -1, withscores=True)
    await conversations.append("key-a", active.id, new_items(raw([said("still here")])))
    await responses._forget("key-a", index)
    assert await texts(conversations, "key-a", active.id) == ["still here"]
    await responses._forget("key-a", await redis_client.zrange(responses.index_key("key-a"), 0, -1, withscores=True))
    assert (await status_of(conversations.retrieve("key-a", active.id)))[0] == 404  # not written since: forgotten


async def test_its_bytes_are_its_items_and_metadata_and_each_change_renews_it(conversations, responses, redis_client):
    async def held() -> tuple[int, int]:
        held = await conversations.items("key-a", made.id)
        meta = await redis_client.hget(conversations.keys("key-a", made.id)[0], "metadata")
        assert int(await redis_client.hget(responses.sizes_key("key-a"), made.id)) == held.size
        return held.size, sum(map(len, held.items)) + len(meta)

    made = await conversations.create("key-a", {"a": "b"}, new_items(raw([said("one")])))
    size, counted = await held()
    assert size == counted
    await conversations.append("key-a", made.id, new_items(raw([said("two"), said("three")])))
    assert (size := (await held())[0]) == (await held())[1]
    await conversations.update("key-a", made.id, {"longer": "metadata than before"})
    assert (await held())[0] == (await held())[1] > size
    await conversations.delete_item("key-a", made.id, (await conversations.item_ids("key-a", made.id))[0])
    assert (await held())[0] == (await held())[1]
    keys = [*conversations.keys("key-a", made.id), responses.index_key("key-a"), responses.sizes_key("key-a")]
    for key in keys:
        await redis_client.expire(key, 5)
    await conversations.update("key-a", made.id, {})
    assert [await redis_client.ttl(key) > 5 for key in keys] == [True] * 5  # renewed to the store's TTL


@pytest.mark.parametrize("responses_ttl, conversation_ttl", [(600, 7200), (7200, 600)])
async def test_a_conversation_is_kept_its_own_ttl_and_its_keys_index_the_longer(redis_client, key_prefix,
                                                                                responses_ttl, conversation_ttl):
    responses = ResponseStore(redis_client, key_prefix=key_prefix, ttl_s=responses_ttl,
                              conversation_ttl_s=conversation_ttl, max_bytes=4096, timeout_s=5.0)
    conversations = ConversationStore(responses)
    made = await conversations.create("key-a", {}, new_items(raw([said("one")])))
    keys = [*conversations.keys("key-a", made.id), responses.index_key("key-a"), responses.sizes_key("key-a")]
    longer = max(responses_ttl, conversation_ttl)

    async def kept() -> bool:
        ttls = [await redis_client.ttl(key) for key in keys]
        return all(t - 10 <= ttl <= t for ttl, t in zip(ttls, [conversation_ttl] * 3 + [longer] * 2))

    assert await kept()
    assert await responses.save("key-a", "resp_" + "1" * 32, StoredResponse(b"{}", []))
    assert await kept()  # the key's index still counts the conversation as long as it lives
    for key in keys:
        await redis_client.expire(key, 5)
    await conversations.append("key-a", made.id, new_items(raw([said("two")])))
    assert await kept()


async def test_a_response_that_would_not_fit_is_refused_before_it_is_generated(conversations, monkeypatch):
    monkeypatch.setattr("gateway.conversation_store.MAX_ITEMS", 4)
    held = Held([msgspec.json.encode(item) for item in new_items(raw([said("a"), said("b")]))], 100)
    conversations.check_room(held, new_items(raw([said("c")])))  # 3 items and the answer's
    with pytest.raises(OpenAIError) as info:
        conversations.check_room(held, new_items(raw([said("c"), said("d")])))
    assert (info.value.param, info.value.code) == ("conversation", "conversation_full")
    with pytest.raises(OpenAIError) as info:
        conversations.check_room(held, new_items(raw([said("x" * 4000)])))  # over the store's 4096 bytes, with its 100
    assert info.value.code == "conversation_full"
    conversations.check_room(Held(held.items, 0), new_items(raw([said("x" * 3800)])))


async def test_a_change_scores_it_past_any_score_read_before_whatever_the_clocks(conversations, responses,
                                                                                  redis_client):
    made = await conversations.create("key-a", {}, [])
    ahead = 4e9  # another gateway's clock ahead of this one's
    await redis_client.zadd(responses.index_key("key-a"), {made.id: ahead})
    index = await redis_client.zrange(responses.index_key("key-a"), 0, -1, withscores=True)
    await conversations.append("key-a", made.id, new_items(raw([said("a")])))
    assert await redis_client.zscore(responses.index_key("key-a"), made.id) > ahead
    await responses._forget("key-a", index)
    assert await texts(conversations, "key-a", made.id) == ["a"]  # written since: kept


async def test_metadata_past_a_conversations_bytes_is_refused_and_changes_nothing(conversations):
    made = await conversations.create("key-a", {"a": "b"}, [])
    big = {f"key{n}": "v" * 500 for n in range(16)}  # 8 kB against the store's 4096 bytes
    assert await status_of(conversations.update("key-a", made.id, big)) == (400, "metadata")
    assert (await conversations.retrieve("key-a", made.id)).metadata == {"a": "b"}
