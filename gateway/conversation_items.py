"""A conversation's items (gateway/conversation_store.py) as they come in and go out: the items a
client adds, checked as a response's input is and stored in the shapes the API lists them in, each
with an id of its own; the items a response adds (its input's, then its output's, with the ids the
response gave them); and the stored items as the chat messages a response reads before its input.
"""
from __future__ import annotations

from typing import Any

import msgspec

from gateway.conversation_store import MAX_NEW_ITEMS, new_item_id
from gateway.json_bounds import bounded_list, items
from gateway.openai_errors import invalid
from gateway.openai_protocol import ChatMessage, decode_at
from gateway.response_items import items_of
from gateway.responses_request import read_input, read_input_item

_new_items_decoder = msgspec.json.Decoder(bounded_list(msgspec.Raw, MAX_NEW_ITEMS), strict=False)


def new_items(raw: msgspec.Raw, field: str = "items") -> list[dict[str, Any]]:
    """The items a client adds (``field``: at most ``MAX_NEW_ITEMS``), each one stored item with a
    new id; a 400 naming the item where one is not a message, function call or call output."""
    stored: list[dict[str, Any]] = []
    for i, element in enumerate(items(decode_at(_new_items_decoder, raw, field))):
        at = f"{field}[{i}]"
        message, _ = read_input_item(element, at)
        if message is None:
            raise invalid(f"{at}: a conversation holds no reasoning items (this model has no reasoning)",
                          f"{at}.type", "unsupported_value")
        stored += items_of([message], new_item_id)
    return stored


def turn_items(input_messages: list[ChatMessage], output: list[msgspec.Struct]) -> list[dict[str, Any]]:
    """What a response adds to its conversation: its input's items (new ids), then its output's."""
    return items_of(input_messages, new_item_id) + [msgspec.to_builtins(item) for item in output]


def history(stored: list[bytes]) -> list[ChatMessage]:
    """A conversation's stored items as the chat messages a response reads before its input."""
    return read_input(msgspec.Raw(b"[" + b",".join(stored) + b"]"), "conversation") if stored else []
