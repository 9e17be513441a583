"""The Responses API (``POST /v1/responses``) in the OpenAPI document (gateway/openapi.py): its
request, whole response and stream events, generated from the structs the gateway decodes and
encodes (gateway/responses_request.py, gateway/responses_output.py), with the checks made in code
added: the kinds of input items and their content parts, the fields accepted only at their default
(``background``, ``store`` and ``previous_response_id`` on a gateway that stores no responses),
``text.format``'s needs and the rules between fields; ``POST /v1/responses/input_tokens`` (the same
request, its model optional); and ``GET`` / ``DELETE /v1/responses/{response_id}`` with its input items
and ``POST .../cancel`` (a background response's) where responses are stored
(gateway/stored_responses.py).
"""
from __future__ import annotations

import copy

import msgspec

from gateway.openai_protocol import MAX_MESSAGES, MAX_PARTS_PER_MESSAGE
from gateway.openapi_conversations import conversation_field, conversation_schemas
from gateway.responses_output import ResponseEvent, ResponseObject
from gateway.responses_request import LOGPROBS_INCLUDE, ResponsesRequest
from gateway.response_items import MAX_LIMIT, ItemList
from gateway.stored_responses import MAX_SEQUENCE, ResponseDeleted

_REF = "#/components/schemas/{name}"
_NULL = {"type": "null"}
_CALL_ID = {"type": "string", "minLength": 1, "maxLength": 256}
_FUNCTION_NAME = {"type": "string", "minLength": 1, "maxLength": 64, "pattern": "^[A-Za-z0-9_.\\-]+$"}
_PART = {"anyOf": [
    {"type": "object", "properties": {"type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"}},
     "required": ["type", "text"]},
    {"type": "object", "properties": {"type": {"const": "refusal"}, "refusal": {"type": "string"}},
     "required": ["type", "refusal"]},
]}
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _PART, "maxItems": MAX_PARTS_PER_MESSAGE}],
            "description": "Text, or text parts (input_text, output_text, refusal) joined; no images or files."}
_ITEM_ID = {"type": "string"}
_ITEM_STATUS = {"enum": ["in_progress", "completed", "incomplete"]}
_INPUT_ITEM = {"anyOf": [
    {"type": "object", "description": "A message (the type may be left out).",
     "properties": {"type": {"const": "message"}, "role": {"enum": ["user", "system", "developer", "assistant"]},
                    "content": _CONTENT, "id": _ITEM_ID, "status": _ITEM_STATUS},
     "required": ["role", "content"], "additionalProperties": False},
    {"type": "object", "description": "A tool call the model made earlier (an assistant's).",
     "properties": {"type": {"const": "function_call"}, "call_id": _CALL_ID, "name": _FUNCTION_NAME,
                    "arguments": {"type": "string"}, "id": _ITEM_ID, "status": _ITEM_STATUS},
     "required": ["type", "call_id", "name", "arguments"], "additionalProperties": False},
    {"type": "object", "description": "A tool call's result: its call_id a function_call before it made (in the "
                                      "input or the history it continues), else a 400 (code function_call_not_found).",
     "properties": {"type": {"const": "function_call_output"}, "call_id": _CALL_ID, "output": _CONTENT,
                    "id": _ITEM_ID, "status": _ITEM_STATUS},
     "required": ["type", "call_id", "output"], "additionalProperties": False},
    {"type": "object", "description": "A reasoning model's reasoning: left out of the prompt.",
     "properties": {"type": {"const": "reasoning"}, "id": _ITEM_ID, "summary": {"type": "array"},
                    "content": {"type": "array"}, "encrypted_content": {"type": ["string", "null"]},
                    "status": _ITEM_STATUS},
     "required": ["type"], "additionalProperties": False},
]}
_REASONING_ITEM = {"properties": {"type": {"const": "reasoning"}}, "required": ["type"]}
_FREE_TEXT = {"anyOf": [_NULL, {"type": "object", "properties": {
    "format": {"anyOf": [_NULL, {"type": "object", "properties": {"type": {"const": "text"}}}]}}}]}


def _implies(field: str, present: dict, then: dict) -> dict:
    return {"if": {"properties": {field: present}, "required": [field]}, "then": then}


_CROSS_FIELD = [
    _implies("top_logprobs", {"type": "integer"},
             {"required": ["include"], "properties": {"include": {"type": "array",
                                                                  "contains": {"const": LOGPROBS_INCLUDE}}}}),
    _implies("tool_choice", {"anyOf": [{"enum": ["auto", "required"]}, {"type": "object"}]},
             {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}),
    _implies("tool_choice", {"anyOf": [{"const": "required"}, {"type": "object"}]},
             {"properties": {"text": _FREE_TEXT, "structured_outputs": _NULL}}),
    _implies("structured_outputs", {"type": "object"}, {"properties": {"text": _FREE_TEXT}}),
    _implies("background", {"const": True}, {"properties": {"store": {"not": {"const": False}}}}),
]
_STATUSES = ["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]


def responses_schemas(model_id: str, vocab_size: int, common_rules: dict[str, dict],
                      stored: bool) -> dict[str, dict]:
    """The schemas ``POST /v1/responses`` names (``common_rules``: the fields' rules shared with the
    other generation endpoints, applied to the fields this request has too; ``stored``: whether the
    gateway stores responses)."""
    (_, _, events, _, _), schemas = msgspec.json.schema_components(
        [ResponsesRequest, ResponseObject, ResponseEvent, ResponseDeleted, ItemList], ref_template=_REF)
    schemas = copy.deepcopy(schemas)
    schemas["ResponseEvent"] = copy.deepcopy(events)
    schemas.pop("InputItem", None), schemas.pop("InputPart", None)  # described by hand above
    request = schemas["ResponsesRequest"]
    props = request["properties"]
    for field in ("service_tier", "prompt_cache_key", "reasoning"):  # taken, not described (they ask for nothing)
        props.pop(field)
    schemas.pop("Reasoning", None)
    for field, rule in common_rules.items():
        if field in props and field != "stream_options":
            props[field] = copy.deepcopy(rule)
    props["model"] = {"type": "string", "enum": [model_id], "description": "The served model."}
    props["input"] = {"anyOf": [{"type": "string"}, {"type": "array", "items": _INPUT_ITEM, "minItems": 1,
                                                     "maxItems": MAX_MESSAGES, "contains": {"not": _REASONING_ITEM}}],
                      "description": "A user message's text, or the conversation's items."}
    if stored:
        props["store"] = {"anyOf": [{"type": "boolean"}, _NULL], "default": True,
                          "description": "Keep the response for previous_response_id and GET /v1/responses/{id}."}
        props["previous_response_id"] = {"anyOf": [{"type": "string", "pattern": "^resp_[0-9a-f]{32}$"}, _NULL],
                                         "description": "Continue a stored response: its conversation comes "
                                                        "before input (its instructions do not); one without "
                                                        "an output (a background response not completed) is a "
                                                        "400."}
        props["background"] = {"type": "boolean", "default": False, "description": (
            "Answer at once (status queued) and generate in the background: poll GET /v1/responses/{id}, "
            "cancel with POST /v1/responses/{id}/cancel. Stored (store may not be false). With stream: true, "
            "its events as they come; the run goes on if the client goes, and GET /v1/responses/{id}?stream=true"
            "&starting_after=N resumes them.")}
        props["conversation"] = conversation_field()
        schemas.update(conversation_schemas(_INPUT_ITEM))
    else:
        props["store"] = {"anyOf": [{"const": False}, _NULL], "description": "Only false: this gateway stores no "
                          "responses (send the whole conversation in input)."}
        props["previous_response_id"] = {**_NULL, "description": "Not supported: this gateway stores no responses."}
        props["background"] = {"type": "boolean", "const": False, "default": False,
                               "description": "Only false: this gateway stores no responses."}
        props["conversation"] = {**_NULL, "description": "Not supported: this gateway stores no responses."}
    schemas.pop("ConversationRef", None)  # (described in conversation_field)
    schemas["ResponseObject"]["properties"]["status"] = {"enum": _STATUSES}
    props["stop_token_ids"]["anyOf"][0]["items"]["maximum"] = vocab_size - 1
    request["allOf"] = _CROSS_FIELD
    schemas["TextFormat"]["allOf"] = [_implies("type", {"const": "json_schema"}, {
        "required": ["name", "schema"], "properties": {"name": {"type": "string"}, "schema": {"type": "object"}}})]
    counting = schemas["ResponsesInputTokensRequest"] = copy.deepcopy(request)
    counting["required"] = ["input"]  # (the model may be left out)
    schemas["ResponsesInputTokens"] = {"type": "object", "required": ["object", "input_tokens"], "properties": {
        "object": {"const": "response.input_tokens"}, "input_tokens": {"type": "integer", "minimum": 0}}}
    return schemas


def input_tokens_path(errors: dict[str, dict], auth: bool) -> dict:
    """``POST /v1/responses/input_tokens``: a response's prompt tokens, counted."""
    return {"/v1/responses/input_tokens": {"post": {
        "summary": "A response's input tokens (its prompt, as the chat template makes it)",
        **({"security": [{"apiKey": []}]} if auth else {}),
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": _REF.format(name="ResponsesInputTokensRequest")}}}},
        "responses": {"200": {"description": "Its input tokens.", "content": {"application/json": {
            "schema": {"$ref": _REF.format(name="ResponsesInputTokens")}}}},
            **{status: errors[status] for status in ("400", "401", "404", "408", "413", "415", "429", "503")}}}}}


def stored_response_paths(errors: dict[str, dict], auth: bool) -> dict:
    """``GET`` and ``DELETE /v1/responses/{response_id}``, its input items, and ``POST .../cancel``
    (``errors``: status -> response object)."""
    parameter = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    security = {"security": [{"apiKey": []}]} if auth else {}
    failures = {status: errors[status] for status in ("400", "401", "429", "503")}
    failures["404"] = {**errors["404"], "description": "This API key has no stored response by that id (never "
                                                       "stored, deleted, or past its time)."}

    def operation(summary: str, answer: str, schema: str, query: tuple = ()) -> dict:
        return {"summary": summary, "parameters": [parameter, *query], **security,
                "responses": {"200": {"description": answer, "content": {"application/json": {
                    "schema": {"$ref": _REF.format(name=schema)}}}}, **failures}}

    paging = ({"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"], "default": "desc"}},
              {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT,
                                                          "default": 20}},
              {"name": "after", "in": "query", "schema": {"type": "string"},
               "description": "An item id of this response's: the page starts after it (else a 400)."})
    resume = ({"name": "stream", "in": "query", "schema": {"type": "boolean", "default": False},
               "description": "A background response created with stream: true: its events (Server-Sent Events) "
                              "from the first (or after starting_after) as they come; another response: a 400."},
              {"name": "starting_after", "in": "query", "schema": {"type": "integer", "minimum": -1,
                                                                  "maximum": MAX_SEQUENCE},
               "description": "With stream: the sequence number of the last event the client has."})
    retrieve = operation("A stored response (this API key's)", "The response as it was answered (a background "
                         "response: as it stands), or with stream=true its events.", "ResponseObject", resume)
    retrieve["responses"]["200"]["content"]["text/event-stream"] = {"schema": {"type": "object"}}
    return {
        "/v1/responses/{response_id}": {
            "get": retrieve,
            "delete": operation("Forget a stored response", "It is forgotten.", "ResponseDeleted"),
        },
        "/v1/responses/{response_id}/input_items": {
            "get": operation("A stored response's input items", "Its request's input, as items (a page of them).",
                             "ItemList", paging),
        },
        "/v1/responses/{response_id}/cancel": {
            "post": operation("Cancel a background response", "The response: cancelled, or as it ended where it had "
                              "(cancelling twice is cancelling once). A response not run in the background is a 400.",
                              "ResponseObject"),
        },
    }


def responses_operation(errors: dict[str, dict], auth: bool) -> dict:
    """``POST /v1/responses``: its request, answer and stream (``errors``: the status -> response
    objects of the other generation endpoints)."""
    payload = {"$ref": _REF.format(name="ResponseEvent")}
    op = {
        "summary": "A response (OpenAI's Responses API)",
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": {"$ref": _REF.format(name="ResponsesRequest")}}}},
        "responses": {
            "200": {"description": "The response (JSON), or with stream: true its events (Server-Sent Events, each "
                                   "'event: <type>' with its JSON; the last response.completed, response.incomplete "
                                   "or response.failed).",
                    "content": {"application/json": {"schema": {"$ref": _REF.format(name="ResponseObject")}},
                                "text/event-stream": {"schema": {
                                    "type": "object", "required": ["data"],
                                    "properties": {"event": {"type": "string"},
                                                   "data": {"type": "string", "contentMediaType": "application/json",
                                                            "contentSchema": payload}}}}}},
            **errors,
        },
    }
    if auth:
        op["security"] = [{"apiKey": []}]
    return op
