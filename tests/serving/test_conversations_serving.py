"""Conversations served (gateway/conversation_routes.py, gateway/responses_endpoints.py): a real gateway,
prefill and decode workers, Redis and the official openai client.  A response created with
``conversation`` is the answer to the conversation's items then its input (greedy: the answer the
same turns get sent whole, and continued by ``previous_response_id``); once it ends, its input's and
output's items are the conversation's next ones -- before a stream's last event, and when a background
response ends -- and items a client adds or deletes are what the next response reads.  The response
names its conversation; ``store: false`` stores the response, not the conversation's turn."""
from __future__ import annotations

import time

import openai
import pytest

DEADLINE_S = 120


def respond(client, stack, input, **params):
    return client.responses.create(model=stack.model_name, input=input, temperature=0, max_output_tokens=6,
                                   **params)


def listed(client, conversation_id: str) -> list:
    return client.conversations.items.list(conversation_id, order="asc", limit=100).data


def texts(items) -> list[tuple[str, str]]:
    return [(i.role, i.content[0].text) for i in items]


def test_responses_in_a_conversation_answer_its_turns_and_add_to_them(client, stack):
    conversation = client.conversations.create()
    first = respond(client, stack, "First turn", conversation=conversation.id)
    second = respond(client, stack, "Second turn", conversation={"id": conversation.id})
    assert first.conversation.id == second.conversation.id == conversation.id
    chained = respond(client, stack, "Second turn", previous_response_id=respond(client, stack, "First turn").id)
    assert (second.output_text, second.usage.input_tokens) == (chained.output_text, chained.usage.input_tokens)
    items = listed(client, conversation.id)
    assert texts(items) == [("user", "First turn"), ("assistant", first.output_text),
                            ("user", "Second turn"), ("assistant", second.output_text)]
    assert [items[1].id, items[3].id] == [first.output[0].id, second.output[0].id]  # the responses' own items
    with pytest.raises(openai.BadRequestError) as info:  # (it keeps its own turn: the conversation holds the rest)
        respond(client, stack, "Aside", previous_response_id=second.id)
    assert info.value.body["code"] == "response_not_continuable"
    counted = client.responses.input_tokens.count(model=stack.model_name, input="Third turn",
                                                  conversation=conversation.id)
    third = respond(client, stack, "Third turn", conversation=conversation.id)
    assert counted.input_tokens == third.usage.input_tokens > second.usage.input_tokens


def test_items_a_client_adds_and_deletes_are_what_the_next_response_reads(client, stack):
    conversation = client.conversations.create(items=[{"role": "user", "content": "Alpha"},
                                                      {"role": "assistant", "content": "Beta"}])
    added = client.conversations.items.create(conversation.id, items=[{"role": "user", "content": "Gamma"}])
    client.conversations.items.delete(listed(client, conversation.id)[1].id, conversation_id=conversation.id)
    answer = respond(client, stack, "Delta", conversation=conversation.id)
    whole = respond(client, stack, [{"role": "user", "content": "Alpha"}, {"role": "user", "content": "Gamma"},
                                    {"role": "user", "content": "Delta"}])
    assert (answer.output_text, answer.usage.input_tokens) == (whole.output_text, whole.usage.input_tokens)
    assert [i.id for i in listed(client, conversation.id)][1] == added.data[0].id


def test_a_streamed_response_stored_or_not_is_in_its_conversation_before_its_last_event(client, stack):
    conversation = client.conversations.create()
    with respond(client, stack, "Stream this", conversation=conversation.id, stream=True, store=False) as events:
        for event in events:
            if event.type == "response.completed" or event.type == "response.incomplete":
                final = event.response  # (the stream is still open: its last event has just come)
                assert texts(listed(client, conversation.id)) == [("user", "Stream this"),
                                                                  ("assistant", final.output_text)]
    assert final.conversation.id == conversation.id


def test_a_background_response_adds_its_turn_when_it_ends(client, stack):
    conversation = client.conversations.create()
    queued = respond(client, stack, "Later", conversation=conversation.id, background=True)
    deadline = time.monotonic() + DEADLINE_S
    while (done := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert texts(listed(client, conversation.id)) == [("user", "Later"), ("assistant", done.output_text)]
    assert done.conversation.id == conversation.id


def test_store_false_keeps_the_conversations_turn_not_the_response(client, stack):
    conversation = client.conversations.create()
    answer = respond(client, stack, "Unstored", conversation=conversation.id, store=False)
    assert answer.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(answer.id)
    assert texts(listed(client, conversation.id)) == [("user", "Unstored"), ("assistant", answer.output_text)]


def test_a_deleted_conversation_cannot_be_answered(client, stack):
    conversation = client.conversations.create()
    client.conversations.delete(conversation.id)
    with pytest.raises(openai.NotFoundError):
        respond(client, stack, "Anyone?", conversation=conversation.id)
