"""The Conversations API on a real gateway in this process (gateway/conversation_routes.py), through the
official openai client: conversations made, read, changed and deleted, their items added, paged,
read and deleted; each API key sees only its own; bad bodies, ids and paging are 4xx naming what is
wrong; a response names a conversation it can read (not one that is not there, nor with
``previous_response_id``), and one that fails adds nothing to it.  No workers: generation is tested
served (tests/serving/test_conversations_serving.py)."""
from __future__ import annotations

import openai
import pytest

from gateway.tenants import key_id
from tests.support.inprocess_gateway import KEYS, gateway

MODEL_ITEM = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]}


def client_of(http, key: str = "a") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key=KEYS[key], max_retries=0)


@pytest.fixture
async def served(served_checkpoint, redis_url, key_prefix, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{KEYS['b']}\n")  # (beside the gateway's own key, a)
    async with gateway(served_checkpoint, redis_url, key_prefix, api_keys_file=str(keys),
                       queue_timeout=0.2) as (gw, http):
        yield gw, http


async def test_a_conversation_is_made_read_changed_and_deleted(served):
    client = client_of(served[1])
    made = await client.conversations.create(items=[MODEL_ITEM], metadata={"topic": "demo"})
    assert (made.object, made.metadata) == ("conversation", {"topic": "demo"})
    assert (await client.conversations.retrieve(made.id)).model_dump() == made.model_dump()
    updated = await client.conversations.update(made.id, metadata={"topic": "other"})
    assert (updated.metadata, updated.created_at) == ({"topic": "other"}, made.created_at)
    deleted = await client.conversations.delete(made.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (made.id, True, "conversation.deleted")
    with pytest.raises(openai.NotFoundError):
        await client.conversations.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        await client.conversations.delete(made.id)


async def test_items_are_added_paged_read_and_deleted(served):
    client = client_of(served[1])
    conversation = await client.conversations.create()
    added = await client.conversations.items.create(conversation.id, items=[
        {"role": "user", "content": f"turn {n}"} for n in range(5)])
    ids = [item.id for item in added.data]
    assert len(set(ids)) == 5 and added.first_id == ids[0] and added.last_id == ids[-1]
    assert [i.content[0].text for i in added.data] == [f"turn {n}" for n in range(5)]
    newest = await client.conversations.items.list(conversation.id, limit=2, include=["message.input_image.image_url"])
    assert ([i.id for i in newest.data], newest.has_more) == (ids[:2:-1], True)
    rest = await client.conversations.items.list(conversation.id, order="asc", after=ids[1])
    assert ([i.id for i in rest.data], rest.has_more) == (ids[2:], False)
    item = await client.conversations.items.retrieve(ids[3], conversation_id=conversation.id,
                                                     include=["message.output_text.logprobs"])
    assert (item.id, item.type, item.role, item.content[0].text) == (ids[3], "message", "user", "turn 3")
    after = await client.conversations.items.delete(ids[3], conversation_id=conversation.id)
    assert after.id == conversation.id
    listed = await client.conversations.items.list(conversation.id, order="asc")
    assert [i.id for i in listed.data] == ids[:3] + ids[4:]
    with pytest.raises(openai.NotFoundError):
        await client.conversations.items.retrieve(ids[3], conversation_id=conversation.id)
    calls = await client.conversations.items.create(conversation.id, items=[
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "done"}])
    assert [(i.type, i.call_id) for i in calls.data] == [("function_call", "call_1"),
                                                         ("function_call_output", "call_1")]


async def test_each_api_key_sees_only_its_own(served):
    mine = await client_of(served[1], "a").conversations.create(items=[MODEL_ITEM])
    theirs = client_of(served[1], "b")
    with pytest.raises(openai.NotFoundError):
        await theirs.conversations.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        await theirs.conversations.items.list(mine.id)
    with pytest.raises(openai.NotFoundError):
        await theirs.conversations.items.create(mine.id, items=[MODEL_ITEM])
    assert len((await client_of(served[1], "a").conversations.items.list(mine.id)).data) == 1


@pytest.mark.parametrize("path, body, param", [
    ("/v1/conversations", {"items": [MODEL_ITEM] * 21}, None),
    ("/v1/conversations", {"items": [{"type": "reasoning", "summary": []}]}, "items[0].type"),
    ("/v1/conversations", {"items": [{"role": "user", "content": [{"type": "input_image"}]}]}, "items[0].content[0]"),
    ("/v1/conversations", {"metadata": {f"k{n}": "v" for n in range(17)}}, "metadata"),
    ("/v1/conversations", {"items": "hello"}, "items"),
    ("/v1/conversations", {"unknown": 1}, None),
    ("/v1/conversations/{id}", {}, "metadata"),
    ("/v1/conversations/{id}/items", {}, "items"),
    ("/v1/conversations/{id}/items", {"items": []}, "items"),
    ("/v1/conversations/{id}/items", {"items": [{"type": "function_call", "name": "f"}]}, "items[0].call_id"),
])
async def test_bad_bodies_are_400s_naming_what_is_wrong(served, path, body, param):
    http = served[1]
    conversation = await client_of(http).conversations.create()
    headers = {"Authorization": f"Bearer {KEYS['a']}"}
    async with http.post(path.replace("{id}", conversation.id), json=body, headers=headers) as resp:
        error = (await resp.json())["error"]
        assert resp.status == 400, error
    if param is not None:
        assert error["param"] == param
    assert (await client_of(http).conversations.items.list(conversation.id)).data == []  # nothing added


async def test_bad_ids_are_404s_and_bad_paging_400s(served):
    client = client_of(served[1])
    conversation = await client.conversations.create(items=[MODEL_ITEM])
    for call in (client.conversations.retrieve("conv_nope"), client.conversations.retrieve("resp_" + "0" * 32),
                 client.conversations.items.retrieve("msg_../x", conversation_id=conversation.id),
                 client.conversations.items.delete("msg_" + "0" * 32, conversation_id=conversation.id)):
        with pytest.raises(openai.NotFoundError):
            await call
    for paging in ({"limit": 0}, {"limit": 101}, {"order": "sideways"}, {"after": "msg_" + "0" * 32}):
        with pytest.raises(openai.BadRequestError):
            await client.conversations.items.list(conversation.id, **paging)


async def test_a_response_names_a_conversation_it_can_read(served):
    client = client_of(served[1])
    conversation = await client.conversations.create(items=[MODEL_ITEM])
    with pytest.raises(openai.NotFoundError) as info:
        await client.responses.create(model=served[0].model_id, input="hi", conversation="conv_" + "0" * 32)
    assert info.value.body["param"] == "conversation"
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model=served[0].model_id, input="hi", conversation=conversation.id,
                                      previous_response_id="resp_" + "0" * 32)
    assert info.value.body["param"] == "conversation"
    other = client_of(served[1], "b")  # not another key's conversation
    with pytest.raises(openai.NotFoundError):
        await other.responses.create(model=served[0].model_id, input="hi", conversation={"id": conversation.id})


async def test_a_response_that_fails_adds_nothing_to_its_conversation(served):
    # No worker: the response waits its queue timeout and fails; its input is not added.
    client = client_of(served[1])
    conversation = await client.conversations.create(items=[MODEL_ITEM])
    with pytest.raises(openai.APIStatusError):
        await client.responses.create(model=served[0].model_id, input="lost", conversation=conversation.id)
    assert len((await client.conversations.items.list(conversation.id)).data) == 1


async def test_a_gateway_that_stores_no_responses_keeps_no_conversations(served_checkpoint, redis_url, key_prefix):
    async with gateway(served_checkpoint, redis_url, key_prefix, responses_store_ttl=0) as (gw, http):
        client = client_of(http)
        with pytest.raises(openai.BadRequestError):
            await client.conversations.create()
        with pytest.raises(openai.BadRequestError) as info:
            await client.responses.create(model=gw.model_id, input="hi", conversation="conv_" + "0" * 32)
        assert info.value.body["param"] == "conversation"


async def test_conversations_are_kept_the_gateways_conversations_ttl(served_checkpoint, redis_url, key_prefix,
                                                                     redis_client):
    async with gateway(served_checkpoint, redis_url, key_prefix, conversations_ttl=1234) as (gw, http):
        made = await client_of(http).conversations.create(items=[MODEL_ITEM])
        for key in gw.conversations.keys(key_id(KEYS["a"]), made.id):
            assert 1224 <= await redis_client.ttl(key) <= 1234


async def test_a_response_its_conversation_has_no_room_for_is_refused_before_it_is_generated(served, monkeypatch):
    monkeypatch.setattr("gateway.conversation_store.MAX_ITEMS", 2)  # (this process's gateway)
    client = client_of(served[1])
    conversation = await client.conversations.create(items=[MODEL_ITEM])
    with pytest.raises(openai.BadRequestError) as info:  # its input and answer: 3 items
        await client.responses.create(model=served[0].model_id, input="one more", conversation=conversation.id)
    assert (info.value.body["param"], info.value.body["code"]) == ("conversation", "conversation_full")
    counted = await client.responses.input_tokens.count(model=served[0].model_id, input="one more",
                                                        conversation=conversation.id)
    assert counted.input_tokens > 0  # counting adds nothing: no room needed
