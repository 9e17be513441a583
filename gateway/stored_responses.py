"""``GET`` and ``DELETE /v1/responses/{response_id}``, ``GET .../input_items`` and ``POST .../cancel``:
an API key's stored responses (gateway/response_store.py) and background responses
(gateway/background_responses.py).

A response's input items are its request's input, rebuilt from the stored conversation as items
(gateway/response_items.py), each with an id of its own (the response's, and its place), and paged
as OpenAI's lists are.
"""
from __future__ import annotations

import itertools
from typing import Any, AsyncContextManager, Callable

import msgspec
from aiohttp import web

from common.cluster.flags import FALSE, TRUE

from gateway.background_responses import BackgroundResponses
from gateway.openai_errors import invalid
from gateway.openai_protocol import ChatMessage
from gateway.response_items import ItemList, items_of, page_of
from gateway.response_store import ResponseStore, store_disabled
from gateway.tenants import Tenant

MAX_SEQUENCE = (1 << 31) - 1  # the largest starting_after


class ResponseDeleted(msgspec.Struct):
    """The answer to ``DELETE /v1/responses/{response_id}``."""

    id: str
    object: str = "response"
    deleted: bool = True


def input_items(messages: list[ChatMessage], response_id: str) -> list[dict[str, Any]]:
    """``messages`` (a request's input, as the chat path read it) as the Responses API's items, each
    with an id of its own: the response's, and its place."""
    tag, place = response_id.removeprefix("resp_"), itertools.count()
    return items_of(messages, lambda kind: f"{kind}_{tag}_{next(place)}")


def _flag(query, name: str) -> bool:
    value = query.get(name, "false").lower()
    if value not in TRUE + FALSE:
        raise invalid(f"{name} must be true or false", name)
    return value in TRUE


def _after(query) -> int:
    """``starting_after``: the sequence number of the last event the client has (-1, the default: none)."""
    try:
        after = int(query.get("starting_after", "-1"))
    except ValueError:
        after = -2
    if not -1 <= after <= MAX_SEQUENCE:
        raise invalid("starting_after must be an event's sequence number (an integer >= -1)", "starting_after")
    return after


def add_stored_response_routes(app: web.Application, store: ResponseStore | None,
                               admission: Callable[[Tenant], AsyncContextManager],
                               stream_admission: Callable[[Tenant], AsyncContextManager],
                               background: BackgroundResponses | None, write_timeout: float) -> None:
    """The routes, each call within its API key's admission (``admission``: the gateway's bound on
    calls on stored responses in flight, overall and per key; ``stream_admission``: its bound on
    streams of background responses, apart, so streams do not keep a key from polling and
    cancelling); ``background``: the background responses this gateway runs (None where none are
    stored); ``write_timeout``: a stream's bound on each write."""
    async def load(request: web.Request):
        if store is None:
            raise store_disabled("response_id")
        async with admission(request["tenant"]):
            return await store.load(request["tenant"].key_id, request.match_info["response_id"])

    async def retrieve(request: web.Request) -> web.StreamResponse:
        """The stored response as it was answered (a background response's as it stands), or a
        streamed background response's events (``stream``, ``starting_after``: ignored without it)."""
        if _flag(request.query, "stream"):
            return await stream(request, _after(request.query))
        return web.Response(body=(await load(request)).response, content_type="application/json")

    async def stream(request: web.Request, after: int) -> web.StreamResponse:
        if store is None:
            raise store_disabled("response_id")
        tenant, response_id = request["tenant"], request.match_info["response_id"]
        async with stream_admission(tenant):  # (held while it streams)
            if not (await store.load(tenant.key_id, response_id)).streamed:
                raise invalid("stream: only a background response created with stream: true is streamed", "stream",
                              "unsupported_value")
            return await background.serve(request, tenant.key_id, response_id, after, write_timeout)

    async def list_input_items(request: web.Request) -> web.Response:
        stored = await load(request)
        items = input_items(stored.input_messages, request.match_info["response_id"])
        page, has_more = page_of(items, request.query, lambda item: item["id"])
        return web.Response(body=msgspec.json.encode(ItemList.of(page, has_more)), content_type="application/json")

    async def delete(request: web.Request) -> web.Response:
        if store is None:
            raise store_disabled("response_id")
        response_id = request.match_info["response_id"]
        async with admission(request["tenant"]):
            await store.delete(request["tenant"].key_id, response_id)
        background.forget(request["tenant"].key_id, response_id)
        return web.Response(body=msgspec.json.encode(ResponseDeleted(response_id)), content_type="application/json")

    async def cancel(request: web.Request) -> web.Response:
        """A background response cancelled (or as it ended, where it had): OpenAI's ``responses.cancel``."""
        if background is None:
            raise store_disabled("response_id")
        async with admission(request["tenant"]):
            answer = await background.cancel(request["tenant"].key_id, request.match_info["response_id"])
        return web.Response(body=answer, content_type="application/json")

    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", delete)
    app.router.add_get("/v1/responses/{response_id}/input_items", list_input_items)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel)
