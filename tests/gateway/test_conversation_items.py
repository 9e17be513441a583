"""A conversation's items as they come in and go out (gateway/conversation_items.py): the items a client
adds are checked as a response's input is (at most 20, no reasoning), a response adds its input's and
its output's items (its own ids, no logprobs), stored items read back as the chat messages a response
is prompted with (function calls added some at a time past a message's bound begin another), and an
unreadable stored item is left out of a list."""
from __future__ import annotations

import json

import msgspec
import pytest

from gateway.conversation_items import history, listed, new_items, turn_items
from gateway.conversation_store import MAX_ITEMS, MAX_NEW_ITEMS
from gateway.openai_errors import OpenAIError
from gateway.openai_protocol import CalledFunction, ChatMessage, MessageToolCall
from gateway.responses_output import FunctionCall, OutputMessage, OutputText


def raw(value) -> msgspec.Raw:
    return msgspec.Raw(json.dumps(value).encode())


def said(text: str, role: str = "user") -> dict:
    return {"role": role, "content": text}


def test_a_call_adds_at_most_twenty_items_and_no_reasoning():
    assert MAX_NEW_ITEMS == 20 and MAX_ITEMS >= 1000
    with pytest.raises(OpenAIError) as info:
        new_items(raw([said("a")] * (MAX_NEW_ITEMS + 1)))
    assert info.value.status == 400
    with pytest.raises(OpenAIError) as info:
        new_items(raw([said("a"), {"type": "reasoning", "summary": []}]))
    assert info.value.param == "items[1].type"
    with pytest.raises(OpenAIError) as info:
        new_items(raw([{"role": "robot", "content": "x"}]))
    assert info.value.param == "items[0].role"


def test_a_responses_items_read_back_as_the_messages_it_was_prompted_with():
    call = MessageToolCall(id="call_1", function=CalledFunction("f", '{"x": 1}'))
    inputs = [ChatMessage(role="user", content="q"), ChatMessage(role="assistant", content=None, tool_calls=[call]),
              ChatMessage(role="tool", content="42", tool_call_id="call_1")]
    output = [OutputMessage(id="msg_" + "0" * 32, status="completed", content=[OutputText(text="so")]),
              FunctionCall(id="fc_" + "1" * 32, call_id="call_2", name="g", arguments="{}", status="completed")]
    items = turn_items(inputs, output)
    assert [i["type"] for i in items] == ["message", "function_call", "function_call_output", "message",
                                          "function_call"]
    assert [i["id"] for i in items[3:]] == ["msg_" + "0" * 32, "fc_" + "1" * 32]  # the response's own ids
    messages = history([msgspec.json.encode(i) for i in items])
    assert [(m.role, m.text(), [c.id for c in m.tool_calls or ()]) for m in messages] == [
        ("user", "q", []), ("assistant", "", ["call_1"]), ("tool", "42", []), ("assistant", "so", ["call_2"])]


def test_function_calls_added_some_at_a_time_are_read_past_a_messages_bound():
    calls = [{"type": "function_call", "call_id": f"c{n}", "name": "f", "arguments": "{}"} for n in range(150)]
    stored = [msgspec.json.encode(item) for n in range(0, 150, 20) for item in new_items(raw(calls[n:n + 20]))]
    messages = history(stored)
    assert [len(m.tool_calls) for m in messages] == [128, 22]


def test_a_responses_logprobs_are_not_added_to_its_conversation():
    text = OutputText(text="so", logprobs=[{"token": "so", "logprob": -0.1, "bytes": [115, 111], "top_logprobs": []}])
    items = turn_items([], [OutputMessage(id="msg_" + "0" * 32, status="completed", content=[text])])
    assert items[0]["content"] == [{"type": "output_text", "text": "so", "annotations": []}]


def test_an_unreadable_stored_item_is_left_out():
    assert listed(b'{"id": "msg_1", "type": "message", "role": "user"}')["role"] == "user"
    assert listed(b'{"type": "message"}') is None and listed(b"[1, 2]") is None and listed(b"\xff") is None
