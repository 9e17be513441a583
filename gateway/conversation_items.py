"""A conversation's items (gateway/conversation_store.py) as they come in and go out: the items a
client adds, checked as a response's input is and stored in the shapes the API lists them in, each
with an id of its own; the items a response adds (its input's, then its output's, with the ids the
response gave them); and the stored items as the chat messages a response reads before its input.
"""
from __future__ import annotations

import logging
from typing import Any

import msgspec

from gateway.conversation_store import MAX_NEW_ITEMS
from gateway.json_bounds import bounded_list, items
from gateway.openai_errors import invalid
from gateway.openai_protocol import ChatMessage, decode_at
from gateway.response_items import items_of, new_item_id
from gateway.responses_request import read_input, read_input_item

log = logging.getLogger(__name__)
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
    """What a response adds to its conversation: its input's items (new ids), then its output's (its
    ids; not its logprobs: they are the response's, not the conversation's)."""
    answer = [msgspec.to_builtins(item) for item in output]
    for item in answer:
        for part in item.get("content", ()):
            part.pop("logprobs", None)
    return items_of(input_messages, new_item_id) + answer


def history(stored: list[bytes]) -> list[ChatMessage]:
    """A conversation's stored items as the chat messages a response reads before its input (function
    calls added some at a time may run past a message's bound on calls: they begin another)."""
    if not stored:
        return []
    return read_input(msgspec.Raw(b"[" + b",".join(stored) + b"]"), "conversation", split_calls=True)


class StoredItem(msgspec.Struct, kw_only=True):
    """What a stored item must hold to be listed (its other fields are the item's kind's)."""

    id: str
    type: str


_stored_item = msgspec.json.Decoder(StoredItem)


def listed(stored: bytes) -> dict[str, Any] | None:
    """A stored item as the API lists it; None where Redis holds something else (logged)."""
    try:
        _stored_item.decode(stored)
        return msgspec.json.decode(stored, type=dict[str, Any])
    except msgspec.MsgspecError:
        log.warning("a conversation's stored item is unreadable; left out")
        return None
