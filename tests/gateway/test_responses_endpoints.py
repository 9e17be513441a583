"""How a response joins its conversation (gateway/responses_endpoints.py ``_joiner``, gateway/
responses_output.py ``ResponsesAnswer.keep``), on a real Redis: its turn is added before its end is
stored (a client polling a background response's end may send the next turn at once), only where it
has an output, and for a background run only while the run holds (not once cancelled); a
conversation gone meanwhile costs the response nothing."""
from __future__ import annotations

import json
from types import SimpleNamespace

import msgspec
import pytest

from gateway.conversation_store import ConversationStore
from gateway.openai_protocol import ChatMessage
from gateway.response_store import ResponseStore
from gateway.responses_endpoints import ResponsesEndpoints
from gateway.responses_output import OutputMessage, OutputText, ResponseObject, ResponsesAnswer
from gateway.responses_request import parse_responses_request
from gateway.tenants import Tenant

TENANT = Tenant("key-a")


@pytest.fixture
def conversations(redis_client, key_prefix):
    return ConversationStore(ResponseStore(redis_client, key_prefix=key_prefix, max_bytes=1 << 16, timeout_s=5.0))


def in_conversation(conversation_id: str):
    return parse_responses_request(json.dumps({"model": "m", "input": "question",
                                               "conversation": conversation_id}).encode())


def ended(status: str = "completed") -> ResponseObject:
    answer = OutputMessage(id="msg_" + "1" * 32, status="completed", content=[OutputText(text="answer")])
    return ResponseObject(id="resp_" + "2" * 32, created_at=0, status=status, model="m", output=[answer], usage=None,
                          instructions=None, max_output_tokens=None, temperature=1.0, top_p=1.0, top_logprobs=None,
                          tools=[], tool_choice="auto", parallel_tool_calls=True, text={}, metadata={}, user=None)


def joiner(conversations, call, still=None):
    handlers = SimpleNamespace(services=SimpleNamespace(conversations=conversations))
    return ResponsesEndpoints._joiner(handlers, call, TENANT, still)


async def texts(conversations, conversation_id: str) -> list[str]:
    held = await conversations.items(TENANT.key_id, conversation_id)
    return [json.loads(item)["content"][0]["text"] for item in held.items]


async def test_a_responses_turn_is_added_before_its_end_is_stored(conversations):
    conversation = await conversations.create(TENANT.key_id, {}, [])
    call = in_conversation(conversation.id)
    seen = []

    async def keeper(response, output, closing):
        seen.append(await texts(conversations, conversation.id))  # what a client polling its end would read
        return True

    answer = ResponsesAnswer(call, shapes=None, keeper=keeper, joiner=joiner(conversations, call))
    await answer.keep(ended())
    assert seen == [["question", "answer"]]


@pytest.mark.parametrize("status", ["failed", "cancelled"])
async def test_a_response_without_an_output_adds_nothing(conversations, status):
    conversation = await conversations.create(TENANT.key_id, {}, [])
    call = in_conversation(conversation.id)
    await ResponsesAnswer(call, shapes=None, joiner=joiner(conversations, call)).keep(ended(status))
    assert await texts(conversations, conversation.id) == []


async def test_a_background_run_joins_only_while_it_holds(conversations):
    conversation = await conversations.create(TENANT.key_id, {}, [])
    call = in_conversation(conversation.id)
    asked = []

    async def cancelled(response_id: str) -> bool:
        asked.append(response_id)
        return False

    await joiner(conversations, call, cancelled)(ended())
    assert asked == ["resp_" + "2" * 32] and await texts(conversations, conversation.id) == []

    async def holds(response_id: str) -> bool:
        return True

    await joiner(conversations, call, holds)(ended())
    assert await texts(conversations, conversation.id) == ["question", "answer"]


async def test_a_conversation_gone_meanwhile_costs_the_response_nothing(conversations):
    conversation = await conversations.create(TENANT.key_id, {}, [])
    call = in_conversation(conversation.id)
    await conversations.delete(TENANT.key_id, conversation.id)
    await joiner(conversations, call)(ended())  # logged, not raised


def test_no_joiner_outside_a_conversation():
    call = parse_responses_request(msgspec.json.encode({"model": "m", "input": [
        {"role": "user", "content": "x"}]}))
    assert joiner(object(), call) is None and call.turns == [ChatMessage(role="user", content="x")]
