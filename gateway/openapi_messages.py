"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) in the OpenAPI
document (gateway/openapi.py): the request's scalar fields from the struct the gateway decodes
(gateway/messages_request.py), the fields it reads by hand described by hand -- each role's content
blocks (a user's text and tool results; an assistant's text, tool uses and thinking), the system
prompt, the tools, ``output_config`` --, the rules between fields the code checks, the message
(gateway/messages_output.py), its stream's events and this API's error shape.
"""
from __future__ import annotations

import copy
from typing import Any

import msgspec

from gateway.messages_output import ErrorEvent, MessageObject
from gateway.messages_request import MessagesRequest
from gateway.openai_protocol import MAX_MESSAGES, MAX_PARTS_PER_MESSAGE, MAX_STOP_LEN, MAX_STOP_STRINGS
from gateway.tools_request import MAX_TOOLS

_REF = "#/components/schemas/{name}"
_NULL = {"type": "null"}
_ID = {"type": "string", "minLength": 1, "maxLength": 256}
_NAME = {"type": "string", "minLength": 1, "maxLength": 64, "pattern": "^[A-Za-z0-9_.\\-]+$"}
# Every block is read with these fields typed, whatever its type (gateway/messages_request.py's Block)
_BLOCK_FIELDS = {"text": {"type": ["string", "null"]}, "id": {"anyOf": [_ID, _NULL]}, "name": {"anyOf": [_NAME, _NULL]},
                 "tool_use_id": {"anyOf": [_ID, _NULL]}, "is_error": {"type": "boolean"}}


def _block(description: str, required: list[str], **own) -> dict:
    return {"type": "object", "description": description, "required": required,
            "properties": {**_BLOCK_FIELDS, **own}}


_TEXT = _block("Text (a block sent back may carry citations, cache_control).", ["type", "text"],
               type={"const": "text"}, text={"type": "string"})
_TEXTS = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT, "maxItems": MAX_PARTS_PER_MESSAGE}]}
_TOOL_RESULT = _block("A tool's result, answering the tool_use of that id.", ["type", "tool_use_id"],
                      type={"const": "tool_result"}, tool_use_id=_ID, content=_TEXTS,
                      is_error={"type": "boolean", "default": False})
_TOOL_USE = _block("A tool call the assistant made.", ["type", "id", "name", "input"],
                   type={"const": "tool_use"}, id=_ID, name=_NAME, input={"type": "object"})
_THINKING = _block("A reasoning model's thinking: left out of the prompt.", ["type"],
                   type={"enum": ["thinking", "redacted_thinking"]})


def _turn(role: str, blocks: list[dict]) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["role", "content"], "properties": {
        "role": {"const": role},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": blocks},
                                                   "maxItems": MAX_PARTS_PER_MESSAGE}]}}}


_TURNS = {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES,
          "items": {"anyOf": [_turn("user", [_TEXT, _TOOL_RESULT]), _turn("assistant", [_TEXT, _TOOL_USE, _THINKING])]},
          "description": "The conversation; a last turn of the assistant's text is continued (a prefill: it "
                         "cannot be constrained too -- 400, code prefill_not_constrainable)."}
_TOOL = {"type": "object", "additionalProperties": False, "required": ["name", "input_schema"], "properties": {
    "name": _NAME, "input_schema": {"type": "object"}, "description": {"type": ["string", "null"]},
    "type": {"anyOf": [{"const": "custom"}, _NULL]}, "strict": {"type": ["boolean", "null"]},
    "cache_control": {"type": ["object", "null"]}}}
_FORMAT = {"type": "object", "additionalProperties": False, "required": ["type", "schema"],
           "properties": {"type": {"const": "json_schema"}, "schema": {"type": "object"}}}
_CONSTRAINED = {"anyOf": [{"required": ["structured_outputs"], "properties": {"structured_outputs": {"type": "object"}}},
                          {"required": ["output_config"], "properties": {"output_config": {
                              "required": ["format"], "properties": {"format": {"type": "object"}}}}}]}


def _implies(present: dict, then: dict) -> dict:
    return {"if": present, "then": then}


_CROSS_FIELD = [
    # a tool choice other than none needs tools; any / tool constrain the output themselves
    _implies({"required": ["tool_choice"], "properties": {"tool_choice": {
        "type": "object", "properties": {"type": {"enum": ["auto", "any", "tool"]}}}}},
        {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}),
    _implies({"required": ["tool_choice"], "properties": {"tool_choice": {
        "type": "object", "properties": {"type": {"enum": ["any", "tool"]}}}}}, {"not": _CONSTRAINED}),
    # output_config.format and structured_outputs: one constraint
    _implies({"required": ["structured_outputs"], "properties": {"structured_outputs": {"type": "object"}}},
             {"properties": {"output_config": {"anyOf": [_NULL, {"type": "object", "properties": {
                 "format": _NULL}}]}}}),
]


def _described(struct: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """``struct`` with its fields read by hand (``msgspec.Raw``) as any value (described below)."""
    def field(f: msgspec.structs.FieldInfo) -> tuple:
        raw = f.type is msgspec.Raw
        if f.required:
            return f.name, Any if raw else f.type
        return f.name, Any if raw else f.type, None if raw else f.default

    return msgspec.defstruct(struct.__name__, [field(f) for f in msgspec.structs.fields(struct)],
                             forbid_unknown_fields=True, kw_only=True)


def messages_schemas(model_id: str, common_rules: dict[str, dict]) -> dict[str, dict]:
    """The schemas the Messages API's operations name (``common_rules``: the rules of the fields it
    shares with the OpenAI endpoints: ``structured_outputs``, ``cache_salt``, ``seed``)."""
    (_, _, _), schemas = msgspec.json.schema_components([_described(MessagesRequest), MessageObject, ErrorEvent],
                                                       ref_template=_REF)
    schemas = copy.deepcopy(schemas)
    for name in ("Block", "Turn", "CustomTool", "OutputConfig", "JsonOutputFormat"):
        schemas.pop(name, None)
    body = schemas["MessagesRequest"]
    props = body["properties"]
    props["model"] = {"type": "string", "enum": [model_id], "description": "The served model."}
    props["messages"] = _TURNS
    props["system"] = {**_TEXTS, "description": "The system prompt: a string, or text blocks joined."}
    props["stop_sequences"] = {"type": "array", "maxItems": MAX_STOP_STRINGS,
                               "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LEN}}
    props["tools"] = {"type": "array", "items": _TOOL, "maxItems": MAX_TOOLS,
                      "description": "Client tools (names unique: else 400, code invalid_tools); no server tools."}
    props["output_config"] = {"type": "object", "additionalProperties": False,
                              "properties": {"format": {"anyOf": [_FORMAT, _NULL]}},
                              "description": "format: JSON valid by the schema (enforced)."}
    props["structured_outputs"] = copy.deepcopy(common_rules["structured_outputs"])
    props["cache_salt"] = copy.deepcopy(common_rules["cache_salt"])
    props["seed"] = copy.deepcopy(common_rules["seed"])
    schemas["ToolChoice"]["allOf"] = [_implies({"properties": {"type": {"const": "tool"}}},
                                               {"required": ["name"], "properties": {"name": {"type": "string"}}})]
    counting = copy.deepcopy(body)
    counting["properties"].pop("stream", None)
    counting["properties"].pop("max_tokens", None)
    body["required"] = sorted({*body.get("required", []), "max_tokens"})
    props["max_tokens"] = props["max_tokens"]["anyOf"][0]  # required, and not null
    body["allOf"] = _CROSS_FIELD
    counting["allOf"] = _CROSS_FIELD
    schemas["MessagesCountTokensRequest"] = counting
    schemas["MessageTokenCount"] = {"type": "object", "required": ["input_tokens"],
                                    "properties": {"input_tokens": {"type": "integer", "minimum": 0}}}
    schemas["MessageEvent"] = _EVENT
    return schemas


_BLOCK_STARTED = {"anyOf": [
    {"type": "object", "required": ["type", "text"], "properties": {"type": {"const": "text"}, "text": {"type": "string"}}},
    {"type": "object", "required": ["type", "id", "name", "input"],
     "properties": {"type": {"const": "tool_use"}, "id": {"type": "string"}, "name": {"type": "string"},
                    "input": {"type": "object"}}}]}
_DELTA = {"anyOf": [
    {"type": "object", "required": ["type", "text"],
     "properties": {"type": {"const": "text_delta"}, "text": {"type": "string"}}},
    {"type": "object", "required": ["type", "partial_json"],
     "properties": {"type": {"const": "input_json_delta"}, "partial_json": {"type": "string"}}}]}
_INDEX = {"type": "integer", "minimum": 0}


def _event(kind: str, **properties) -> dict:
    return {"type": "object", "required": ["type", *properties],
            "properties": {"type": {"const": kind}, **properties}}


_EVENT = {"anyOf": [
    _event("message_start", message={"$ref": _REF.format(name="MessageObject")}),
    _event("content_block_start", index=_INDEX, content_block=_BLOCK_STARTED),
    _event("content_block_delta", index=_INDEX, delta=_DELTA),
    _event("content_block_stop", index=_INDEX),
    _event("message_delta", delta={"type": "object", "required": ["stop_reason"], "properties": {
        "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
        "stop_sequence": {"type": ["string", "null"]}}},
           usage={"type": "object", "required": ["output_tokens"],
                  "properties": {"output_tokens": {"type": "integer", "minimum": 0}}}),
    _event("message_stop"),
    _event("error", error={"$ref": _REF.format(name="ErrorDetail")}),
]}


def messages_paths(errors: dict[str, str], auth: bool) -> dict:
    """``POST /v1/messages`` and ``/v1/messages/count_tokens`` (``errors``: status -> description;
    their bodies are this API's error shape)."""
    failures = {status: {"description": text, "content": {"application/json": {"schema": {
        "$ref": _REF.format(name="ErrorEvent")}}}} for status, text in errors.items()}
    security = {"security": [{"apiKey": []}]} if auth else {}

    def operation(summary: str, request: str, answer: dict) -> dict:
        return {"summary": summary, **security, "responses": {"200": answer, **failures}, "requestBody": {
            "required": True, "content": {"application/json": {"schema": {"$ref": _REF.format(name=request)}}}}}

    stream = {"type": "object", "required": ["data"], "properties": {
        "event": {"type": "string"},
        "data": {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"$ref": _REF.format(name="MessageEvent")}}}}
    return {
        "/v1/messages": {"post": operation(
            "A message (Anthropic's Messages API; the key as x-api-key or a bearer token)", "MessagesRequest",
            {"description": "The message (JSON), or with stream: true its events (Server-Sent Events, each "
                            "'event: <type>' with its JSON; the last message_stop, or error).",
             "content": {"application/json": {"schema": {"$ref": _REF.format(name="MessageObject")}},
                         "text/event-stream": {"schema": stream}}})},
        "/v1/messages/count_tokens": {"post": operation(
            "The prompt's tokens, as the chat template makes them", "MessagesCountTokensRequest",
            {"description": "Its input tokens.",
             "content": {"application/json": {"schema": {"$ref": _REF.format(name="MessageTokenCount")}}}})},
    }
