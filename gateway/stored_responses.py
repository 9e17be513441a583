"""``GET`` and ``DELETE /v1/responses/{response_id}``: an API key's stored responses (gateway/response_store.py)."""
from __future__ import annotations

import msgspec
from aiohttp import web

from gateway.openai_errors import invalid
from gateway.response_store import ResponseStore, store_disabled


class ResponseDeleted(msgspec.Struct):
    id: str
    object: str = "response"
    deleted: bool = True


def add_stored_response_routes(app: web.Application, store: ResponseStore | None) -> None:
    async def retrieve(request: web.Request) -> web.Response:
        """The stored response as it was answered (a stream's replay is not offered)."""
        if store is None:
            raise store_disabled("response_id")
        for name in ("stream", "starting_after"):
            if request.query.get(name, "false").lower() not in ("false", "0"):
                raise invalid(f"{name}: a stored response is returned whole (no stream replay)", name,
                              "unsupported_value")
        stored = await store.load(request["tenant"].key_id, request.match_info["response_id"])
        return web.Response(body=stored.response, content_type="application/json")

    async def delete(request: web.Request) -> web.Response:
        if store is None:
            raise store_disabled("response_id")
        response_id = request.match_info["response_id"]
        await store.delete(request["tenant"].key_id, response_id)
        return web.Response(body=msgspec.json.encode(ResponseDeleted(response_id)), content_type="application/json")

    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", delete)
