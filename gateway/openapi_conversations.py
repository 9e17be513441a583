"""The Conversations API (gateway/conversation_routes.py) in the OpenAPI document (gateway/openapi.py),
where the gateway stores responses: its operations, their bodies (items as a response's input items
are described, no reasoning ones, at most ``MAX_NEW_ITEMS`` a call; metadata as a response's) and
answers, generated from the structs it encodes; and ``conversation`` on ``POST /v1/responses``.
"""
from __future__ import annotations

import copy

import msgspec

from gateway.conversation_store import MAX_NEW_ITEMS, Conversation, ConversationDeleted
from gateway.response_items import MAX_LIMIT

_REF = "#/components/schemas/{name}"
_NULL = {"type": "null"}
CONVERSATION_ID = {"type": "string", "pattern": "^conv_[0-9a-f]{32}$"}
_METADATA = {"anyOf": [{"type": "object", "maxProperties": 16, "propertyNames": {"maxLength": 64},
                        "additionalProperties": {"type": "string", "maxLength": 512}}, _NULL],
             "description": "At most 16 string pairs (keys of at most 64 characters, values of 512)."}


def conversation_field() -> dict:
    """``conversation`` on ``POST /v1/responses`` (where responses are stored)."""
    return {"anyOf": [CONVERSATION_ID, {"type": "object", "properties": {"id": CONVERSATION_ID}, "required": ["id"],
                                        "additionalProperties": False}, _NULL],
            "description": "A conversation of this API key's (POST /v1/conversations): its items come before input, "
                           "and once the response has an output its input's and output's items are added to it. "
                           "Not with previous_response_id; one that is not there is a 404."}


def conversation_schemas(input_item: dict) -> dict[str, dict]:
    """The schemas the operations name (``input_item``: a response's input item, as described there)."""
    (_, _), schemas = msgspec.json.schema_components([Conversation, ConversationDeleted], ref_template=_REF)
    schemas = copy.deepcopy(schemas)
    item = {"anyOf": [kind for kind in input_item["anyOf"] if kind["properties"]["type"].get("const") != "reasoning"]}
    items = {"type": "array", "items": item, "maxItems": MAX_NEW_ITEMS}
    schemas["ConversationCreate"] = {"type": "object", "additionalProperties": False, "properties": {
        "items": {"anyOf": [items, _NULL]}, "metadata": _METADATA,
        "safety_identifier": {"anyOf": [{"type": "string", "maxLength": 256}, _NULL]}}}
    schemas["ConversationUpdate"] = {"type": "object", "additionalProperties": False, "required": ["metadata"],
                                     "properties": {"metadata": _METADATA}}
    schemas["ConversationItemsCreate"] = {"type": "object", "additionalProperties": False, "required": ["items"],
                                          "properties": {"items": {**items, "minItems": 1}}}
    schemas["ConversationItem"] = {"type": "object", "required": ["id", "type"],
                                   "properties": {"id": {"type": "string"}, "type": {"type": "string"}}}
    return schemas


def conversation_paths(errors: dict[str, dict], auth: bool) -> dict:
    """The operations (``errors``: status -> response object)."""
    conversation_id = {"name": "conversation_id", "in": "path", "required": True, "schema": {"type": "string"}}
    item_id = {"name": "item_id", "in": "path", "required": True, "schema": {"type": "string"}}
    include = {"name": "include", "in": "query", "schema": {"type": "array", "items": {"type": "string"}},
               "description": "OpenAI's extra data (image urls, search results): accepted; these items hold none."}
    paging = ({"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"], "default": "desc"}},
              {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT,
                                                          "default": 20}},
              {"name": "after", "in": "query", "schema": {"type": "string"},
               "description": "An item id of this conversation's: the page starts after it (else a 400)."}, include)
    security = {"security": [{"apiKey": []}]} if auth else {}
    missing = {**errors["404"], "description": "This API key has no conversation (or item) by that id."}

    def operation(summary: str, answer: str, schema: str, parameters: tuple = (), body: str | None = None,
                  found: bool = True) -> dict:
        statuses = ("400", "401", "408", "413", "415", "429", "503") if body else ("400", "401", "429", "503")
        op = {"summary": summary, "parameters": list(parameters), **security,
              "responses": {"200": {"description": answer, "content": {"application/json": {
                  "schema": {"$ref": _REF.format(name=schema)}}}},
                  **{status: errors[status] for status in statuses}, **({"404": missing} if found else {})}}
        if body:
            op["requestBody"] = {"required": body != "ConversationCreate", "content": {"application/json": {
                "schema": {"$ref": _REF.format(name=body)}}}}
        return op

    one = (conversation_id,)
    return {
        "/v1/conversations": {"post": operation(
            "A new conversation (this API key's)", "The conversation.", "Conversation", body="ConversationCreate",
            found=False)},
        "/v1/conversations/{conversation_id}": {
            "get": operation("A conversation", "The conversation.", "Conversation", one),
            "post": operation("A conversation's metadata replaced", "The conversation.", "Conversation", one,
                              body="ConversationUpdate"),
            "delete": operation("Forget a conversation and its items", "It is forgotten.", "ConversationDeleted", one),
        },
        "/v1/conversations/{conversation_id}/items": {
            "post": operation("Items added to a conversation (after its others)", "The items added, with their ids.",
                              "ItemList", (conversation_id, include), body="ConversationItemsCreate"),
            "get": operation("A conversation's items", "A page of them.", "ItemList", (conversation_id, *paging)),
        },
        "/v1/conversations/{conversation_id}/items/{item_id}": {
            "get": operation("A conversation's item", "The item.", "ConversationItem", (conversation_id, item_id,
                                                                                       include)),
            "delete": operation("An item deleted from a conversation", "The conversation.", "Conversation",
                                (conversation_id, item_id)),
        },
    }
