"""The Responses API's items, as a stored response's input items and a conversation's items list them:
the chat path's messages back as items (``items_of``), and pages of them (``page_of``).

A message becomes a ``message`` item (an assistant's text an ``output_text`` part, the others'
``input_text``), each of an assistant's tool calls a ``function_call`` item, a tool message a
``function_call_output`` item.  Pages are OpenAI's: ``order`` ``desc`` (the default) or ``asc``,
``limit`` 1-100 (20), ``after`` an item id.
"""
from __future__ import annotations

import uuid
from typing import Any, Callable, Sequence, TypeVar

import msgspec

from gateway.openai_errors import invalid
from gateway.openai_protocol import ChatMessage

MAX_LIMIT = 100
T = TypeVar("T")


class ItemList(msgspec.Struct):
    """A page of items (a stored response's input items, a conversation's items), as OpenAI's lists are."""

    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: str = "list"

    @classmethod
    def of(cls, page: list[dict[str, Any]], has_more: bool = False) -> "ItemList":
        return cls(page, page[0]["id"] if page else None, page[-1]["id"] if page else None, has_more)


def new_item_id(kind: str) -> str:
    """A new item id of that kind (``msg``, ``fc``, ``fco``)."""
    return f"{kind}_{uuid.uuid4().hex}"


def items_of(messages: list[ChatMessage], new_id: Callable[[str], str]) -> list[dict[str, Any]]:
    """``messages`` (as the chat path read them) as items, each with the id ``new_id(kind)`` gives
    (``kind``: ``msg``, ``fc`` or ``fco``)."""
    items: list[dict[str, Any]] = []

    def add(kind: str, **fields) -> None:
        items.append({"id": new_id(kind), **fields, "status": "completed"})

    for m in messages:
        if m.role == "tool":
            add("fco", type="function_call_output", call_id=m.tool_call_id, output=m.text())
        elif m.role == "assistant":
            if m.text() or not m.tool_calls:
                add("msg", type="message", role="assistant",
                    content=[{"type": "output_text", "text": m.text(), "annotations": []}])
            for call in m.tool_calls or ():
                add("fc", type="function_call", call_id=call.id, name=call.function.name,
                    arguments=call.function.arguments)
        else:
            add("msg", type="message", role=m.role, content=[{"type": "input_text", "text": m.text()}])
    return items


def page_of(listed: Sequence[T], query, id_of: Callable[[T], str]) -> tuple[list[T], bool]:
    """The page of ``listed`` (oldest first) that ``query`` asks for, and whether more follow it; bad
    paging is a 400 naming the parameter."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid(f"order must be asc or desc, got {order[:16]!r}", "order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise invalid(f"limit must be an integer from 1 to {MAX_LIMIT}", "limit")
    ordered = list(listed) if order == "asc" else list(listed)[::-1]
    if "after" in query:
        at = next((i for i, element in enumerate(ordered) if id_of(element) == query["after"]), None)
        if at is None:
            raise invalid("after names no item of this list", "after", "item_not_found")
        ordered = ordered[at + 1:]
    return ordered[:limit], len(ordered) > limit
