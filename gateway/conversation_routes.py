"""OpenAI's Conversations API (``client.conversations``): an API key's conversations and their items
(gateway/conversation_store.py), which a response created with ``conversation`` reads and adds to.

    POST   /v1/conversations                               {"items"?, "metadata"?} -> the conversation
    GET    /v1/conversations/{conversation_id}             -> the conversation
    POST   /v1/conversations/{conversation_id}             {"metadata"} -> the conversation, its metadata replaced
    DELETE /v1/conversations/{conversation_id}             -> {"id", "object": "conversation.deleted", "deleted"}
    POST   /v1/conversations/{conversation_id}/items       {"items"} -> the list of the items added
    GET    /v1/conversations/{conversation_id}/items       ?order&limit&after -> a page of its items
    GET    /v1/conversations/{conversation_id}/items/{id}  -> the item
    DELETE /v1/conversations/{conversation_id}/items/{id}  -> the conversation

Each call is one of its API key's calls on stored objects (the gateway's bound on them in flight,
overall and per key); bodies are bounded as every body is, then item by item (at most
``MAX_NEW_ITEMS`` a call), metadata as a response's.  ``include`` (OpenAI's extra data: image urls,
search results, logprobs) is accepted and asks for nothing here: the items hold none.
"""
from __future__ import annotations

from typing import AsyncContextManager, Awaitable, Callable

import msgspec
from aiohttp import web

from gateway.conversation_items import listed, new_items
from gateway.conversation_store import ConversationDeleted, ConversationStore, item_not_found
from gateway.openai_errors import invalid
from gateway.openai_protocol import UserId, decode_body, given, read_metadata
from gateway.response_items import ItemList, page_of
from gateway.response_store import store_disabled
from gateway.tenants import Tenant


class ConversationCreate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/conversations`` (``items`` and ``metadata`` read apart, bounded)."""

    items: msgspec.Raw = msgspec.Raw()
    metadata: msgspec.Raw = msgspec.Raw()
    safety_identifier: UserId | None = None  # OpenAI's abuse monitoring: accepted, not used


class ConversationUpdate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/conversations/{conversation_id}``: its new metadata (null: none)."""

    metadata: msgspec.Raw


class ItemsCreate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/conversations/{conversation_id}/items``."""

    items: msgspec.Raw


_create_decoder = msgspec.json.Decoder(ConversationCreate, strict=False)
_update_decoder = msgspec.json.Decoder(ConversationUpdate, strict=False)
_items_decoder = msgspec.json.Decoder(ItemsCreate, strict=False)


def _json(value) -> web.Response:
    return web.Response(body=msgspec.json.encode(value), content_type="application/json")


def _items_page(found: list[bytes], has_more: bool = False) -> web.Response:
    return _json(ItemList.of([item for item in map(listed, found) if item is not None], has_more))


def add_conversation_routes(app: web.Application, conversations: ConversationStore | None,
                            admission: Callable[[Tenant], AsyncContextManager],
                            read_body: Callable[[web.Request], Awaitable[bytes]]) -> None:
    """The routes (a 400 naming ``conversation_id`` on a gateway that stores no responses), each call
    within its API key's ``admission`` on stored objects; ``read_body``: the gateway's bounded read."""
    def store() -> ConversationStore:
        if conversations is None:
            raise store_disabled("conversation_id")
        return conversations

    async def create(request: web.Request) -> web.Response:
        body = decode_body(_create_decoder, await read_body(request) or b"{}")  # (its body may be left out)
        metadata = read_metadata(body.metadata) if given(body.metadata) else {}
        items = new_items(body.items) if given(body.items) else []
        async with admission(request["tenant"]):
            return _json(await store().create(request["tenant"].key_id, metadata, items))

    async def retrieve(request: web.Request) -> web.Response:
        async with admission(request["tenant"]):
            return _json(await store().retrieve(request["tenant"].key_id, request.match_info["conversation_id"]))

    async def update(request: web.Request) -> web.Response:
        body = decode_body(_update_decoder, await read_body(request))
        metadata = read_metadata(body.metadata) if given(body.metadata) else {}
        async with admission(request["tenant"]):
            return _json(await store().update(request["tenant"].key_id, request.match_info["conversation_id"],
                                              metadata))

    async def delete(request: web.Request) -> web.Response:
        conversation_id = request.match_info["conversation_id"]
        async with admission(request["tenant"]):
            await store().delete(request["tenant"].key_id, conversation_id)
        return _json(ConversationDeleted(conversation_id))

    async def add_items(request: web.Request) -> web.Response:
        body = decode_body(_items_decoder, await read_body(request))
        if not given(body.items):
            raise invalid("Missing required parameter: 'items'.", "items", "missing_required_parameter")
        items = new_items(body.items)
        if not items:
            raise invalid("items holds no item", "items")
        async with admission(request["tenant"]):
            await store().append(request["tenant"].key_id, request.match_info["conversation_id"], items)
        return _json(ItemList.of(items))

    async def list_items(request: web.Request) -> web.Response:
        key_id, conversation_id = request["tenant"].key_id, request.match_info["conversation_id"]
        async with admission(request["tenant"]):
            found, has_more = await store().page(key_id, conversation_id,
                                                 lambda ids: page_of(ids, request.query, lambda item_id: item_id))
        return _items_page(found, has_more)

    async def retrieve_item(request: web.Request) -> web.Response:
        async with admission(request["tenant"]):
            item = listed(await store().item(request["tenant"].key_id, request.match_info["conversation_id"],
                                             request.match_info["item_id"]))
        if item is None:
            raise item_not_found()
        return _json(item)

    async def delete_item(request: web.Request) -> web.Response:
        async with admission(request["tenant"]):
            return _json(await store().delete_item(request["tenant"].key_id, request.match_info["conversation_id"],
                                                   request.match_info["item_id"]))

    app.router.add_post("/v1/conversations", create)
    app.router.add_get("/v1/conversations/{conversation_id}", retrieve)
    app.router.add_post("/v1/conversations/{conversation_id}", update)
    app.router.add_delete("/v1/conversations/{conversation_id}", delete)
    app.router.add_post("/v1/conversations/{conversation_id}/items", add_items)
    app.router.add_get("/v1/conversations/{conversation_id}/items", list_items)
    app.router.add_get("/v1/conversations/{conversation_id}/items/{item_id}", retrieve_item)
    app.router.add_delete("/v1/conversations/{conversation_id}/items/{item_id}", delete_item)
