"""The public API as an OpenAPI 3.1 document, served by the gateway at ``GET /openapi.json``.

The request and response schemas are generated from the msgspec structs the gateway decodes and
encodes (``gateway/openai_protocol.py``), so their types, ranges, required fields and "no unknown
field" are the ones enforced.  The checks the gateway makes in code after decoding are added to
the generated schemas here (``_REQUEST_RULES``): the served model name, the fields that are
accepted only at their default (``suffix``), the limits on ``stop`` and
``logit_bias``, the shapes of ``prompt``, text-only message parts, the wire shapes of
``response_format`` and ``structured_outputs``, the rules between a tool message and its call.
Whether a grammar compiles is a 400 with the code ``invalid_grammar``; a ``tool_choice`` naming a
function the tools lack, or tools with one name twice, a 400 with the code ``invalid_tools``.  What no schema can say (the
prompt's length in tokens against the context, two fields that must agree) is a 400 in OpenAI's
error shape, described in each operation.

The admin API (``/admin/*``) is for operators, not clients, and is not described here; nor is
Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``), whose shapes are Anthropic's
(gateway/messages_request.py says what is honoured).
"""
from __future__ import annotations

import copy
from typing import Any

import msgspec

from common.engine.kv.prefix_hash import MAX_CACHE_SALT_LEN
from common.engine.sampling_params import (
    INT64_MAX, INT64_MIN, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_VALUE, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS, MAX_TOKEN_ID,
)
from gateway.openai_protocol import (
    MAX_CONTENT_PARTS, MAX_N, MAX_PARTS_PER_MESSAGE, MAX_STOP_LEN, MAX_STOP_STRINGS, ChatCompletionChunk,
    ChatCompletionRequest, ChatCompletionResponse, CompletionChunk, CompletionRequest, CompletionResponse,
    ErrorResponse, ModelList,
)
from gateway.openapi_conversations import conversation_paths
from gateway.tools_request import MAX_TOOLS
from gateway.openapi_messages import messages_paths, messages_schemas
from gateway.openapi_responses import input_tokens_path, responses_operation, responses_schemas, stored_response_paths
from gateway.prompt_input import MAX_REQUEST_CHOICES
from gateway.template_kwargs import MAX_TEMPLATE_KWARGS, RESERVED
from gateway.request_extensions import UNDOCUMENTED
from gateway.structured_request import ResponseFormat, StructuredOutputsParams

_REF = "#/components/schemas/{name}"
_NULL = {"type": "null"}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, _NULL], "default": None}


_STOP_STRING = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LEN}
_COMMON_RULES: dict[str, dict] = {
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_N, "default": 1,
          "description": "Choices; the prompt is computed once and shared."},
    "logit_bias": {**_nullable({"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                                "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS_VALUE,
                                                         "maximum": MAX_LOGIT_BIAS_VALUE}}),
                   "description": "Token id (a decimal string, inside the vocabulary) -> bias added to its logit."},
    "store": {"type": "boolean", "const": False, "default": False, "description": "Only false: no stored completions."},
    "prompt_logprobs": {**_nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}),
                        "description": "Extension (vLLM's). Each prompt token's logprob, rank and this many top "
                                       "alternatives in the answer's prompt_logprobs; not with stream (400, code "
                                       "prompt_logprobs_not_streamed)."},
    "min_tokens": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID, "default": 0,
                   "description": "Extension (vLLM's). No stop token or stop string ends the output within its first min_tokens tokens; at most max_tokens (or what the context leaves)."},
    "stop_token_ids": {**_nullable({"type": "array", "maxItems": MAX_STOP_TOKEN_IDS,
                                    "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}}),
                       "description": "Extension (vLLM's). Token ids that end the output."},
    "response_format": {**_nullable({"$ref": _REF.format(name="ResponseFormat")}),
                        "description": "json_object or json_schema (strict or not: enforced either way). A schema "
                                       "the grammar backend cannot compile is a 400 (code invalid_grammar)."},
    "structured_outputs": {**_nullable({"$ref": _REF.format(name="StructuredOutputsParams")}),
                           "description": "Extension (vLLM's): one of json, regex, choice, grammar (Lark or GBNF), "
                                          "json_object. Not together with response_format."},
    "top_k": {**_nullable({"type": "integer", "minimum": -1, "maximum": INT64_MAX}),
              "description": "Extension. 0, -1 or null: off. At or above the vocabulary size: off."},
    "seed": _nullable({"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX}),
    "stop": {"anyOf": [_STOP_STRING, {"type": "array", "items": _STOP_STRING, "maxItems": MAX_STOP_STRINGS},
                       _NULL], "default": None},
    "cache_salt": {**_nullable({"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_LEN}),
                   "description": "Extension (vLLM's). Requests share prefix-cache blocks only with "
                                  "requests of the same salt; see SECURITY.md."},
    "stream_options": {**_nullable({"$ref": _REF.format(name="StreamOptions")}),
                       "description": "Only with stream: true."},
}
_REQUEST_RULES: dict[str, dict[str, dict]] = {
    "CompletionRequest": {
        **_COMMON_RULES,
        "prompt": {"anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID},
             "description": "Token ids, each inside the model's vocabulary."},
            {"type": "array", "minItems": 1, "maxItems": MAX_REQUEST_CHOICES, "items": {"type": "string", "minLength": 1},
             "description": f"A batch of prompts (choice p * n + i is choice i of prompt p; prompts times n at most "
                            f"{MAX_REQUEST_CHOICES})."},
            {"type": "array", "minItems": 1, "maxItems": MAX_REQUEST_CHOICES,
             "items": {"type": "array", "minItems": 1,
                       "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}},
             "description": "A batch of prompts as token ids."},
        ]},
        "echo": {"type": "boolean", "default": False,
                 "description": "The prompt before the completion; with logprobs, its tokens' logprobs too (the "
                                "first token has none)."},
        "best_of": {**_nullable({"type": "integer", "minimum": 1, "maximum": MAX_N}),
                    "description": "Candidates per prompt, at least n; the n of the highest cumulative logprob are "
                                   "answered, every candidate counted in the usage. Not with stream."},
        "suffix": {**_nullable({"type": "string", "maxLength": 0}), "description": "Not supported."},
    },
    "ChatCompletionRequest": {
        **_COMMON_RULES,
        "top_logprobs": {**_nullable({"type": "integer", "minimum": 0, "maximum": 20}),
                         "description": "Only with logprobs: true."},
        "max_tokens": {**_nullable({"type": "integer", "minimum": 1, "maximum": MAX_TOKEN_ID}),
                       "description": "Deprecated alias of max_completion_tokens; if both are sent they must agree."},
        "chat_template_kwargs": {**_nullable({"type": "object", "maxProperties": MAX_TEMPLATE_KWARGS,
                                              "propertyNames": {"not": {"enum": sorted(RESERVED)}}}),
                                 "description": "Extension (vLLM's). Variables for the chat template (e.g. "
                                                "enable_thinking); not the names of its parameters, special tokens "
                                                "or functions."},
        "add_generation_prompt": {"type": "boolean", "default": True,
                                  "description": "Extension (vLLM's). The template's prompt for the answer's turn."},
        "continue_final_message": {"type": "boolean", "default": False,
                                   "description": "Extension (vLLM's). The answer goes on from the last message's text "
                                                  "(the generation prompt is then left out); a last message holding "
                                                  "tool calls is a 400 (code last_message_not_continuable)."},
    },
    "ChatMessage": {
        "tool_calls": {**_nullable({"type": "array", "items": {"$ref": _REF.format(name="MessageToolCall")},
                                    "maxItems": MAX_TOOLS, "minItems": 1}),
                       "description": "An assistant's tool calls (then content may be null)."},
        "content": {"anyOf": [{"type": "string"},
                              {"type": "array", "items": {"$ref": _REF.format(name="ContentPart")},
                               "maxItems": MAX_PARTS_PER_MESSAGE}],
                    "description": f"At most {MAX_CONTENT_PARTS} parts in all the messages together."},
    },
}
# A message needs its content; a content part must be text.
_SCHEMA_RULES: dict[str, dict] = {
    "ContentPart": {"type": "object", "properties": {"type": {"type": "string", "const": "text"},
                                                      "text": {"type": "string"}},
                    "required": ["type", "text"]},
}
_REQUIRED_EXTRA = {"ChatMessage": ["content"]}


def _implies(field: str, present: dict, then: dict) -> dict:
    """``field`` with a value matching ``present`` requires ``then`` (JSON Schema if/then)."""
    return {"if": {"properties": {field: present}, "required": [field]}, "then": then}


# Rules between fields (stricter than the gateway where JSON Schema cannot say "equal": a chat
# request may carry max_tokens or max_completion_tokens, the gateway also takes both if equal).
_STREAM_OPTIONS_NEED_STREAM = _implies("stream_options", {"type": "object"},
                                       {"properties": {"stream": {"const": True}}, "required": ["stream"]})
# (vLLM's prompt_logprobs are not streamed: a rule the document states in the field's description,
# as one more rule here leaves the chat request's schema too complex to generate requests from.)
_CROSS_FIELD: dict[str, list[dict]] = {
    "CompletionRequest": [_STREAM_OPTIONS_NEED_STREAM,
                          # max_tokens 0 answers the prompt alone: with echo only
                          _implies("max_tokens", {"const": 0}, {"properties": {"echo": {"const": True}},
                                                                "required": ["echo"]}),
                          # (stricter than the gateway: best_of >= n, its candidates of a batch at most 32)
                          _implies("best_of", {"type": "integer"}, {"properties": {
                              "n": {"const": 1}, "stream": {"const": False},
                              "prompt": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]}}})],
    "ChatCompletionRequest": [
        _STREAM_OPTIONS_NEED_STREAM,
        _implies("top_logprobs", {"type": "integer"},
                 {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}),
        _implies("max_tokens", {"type": "integer"}, {"properties": {"max_completion_tokens": _NULL}}),
        _implies("tool_choice", {"anyOf": [{"enum": ["auto", "required"]}, {"type": "object"}]},
                 {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}),
        _implies("tool_choice", {"anyOf": [{"const": "required"}, {"type": "object"}]},
                 {"properties": {"response_format": _NULL, "structured_outputs": _NULL}}),
    ],
}

_HEALTH = {
    "type": "object",
    "properties": {
        "status": {"type": "string", "enum": ["ok", "degraded", "unavailable"]},
        "model": {"type": "string"},
        "redis": {"type": "boolean"},
        "workers": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}},
        "pools": {"type": "object", "additionalProperties": {
            "type": "object", "properties": {"healthy": {"type": "integer", "minimum": 0},
                                             "benched": {"type": "integer", "minimum": 0}},
            "required": ["healthy", "benched"]}},
        "problems": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["status", "model", "redis", "workers", "pools", "problems"],
}

_ERRORS = {
    "400": "Invalid parameters, or a prompt longer than the model's context allows.",
    "401": "Missing or unknown API key.",
    "404": "The model is not the one this server serves.",
    "408": "The request body did not arrive in time.",
    "413": "The request body is too large.",
    "415": "The request body's Content-Type is not application/json.",
    "429": "Too many requests in flight (overall or for this API key); see Retry-After.",
    "500": "The generation failed inside the cluster.",
    "502": "No decode worker gave an answer the gateway could read (an error page instead of a token stream).",
    "503": "Saturated, or no worker can serve; see Retry-After.",
}


def _error(description: str) -> dict:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": _REF.format(name="ErrorResponse")}}}}


def _events(chunk: str) -> dict:
    """One Server-Sent Event of a stream (Open API 3.1: the schema of a text/event-stream is that
    of each event): a chunk, an error after the stream started, or the final ``[DONE]``."""
    payload = {"anyOf": [{"$ref": _REF.format(name=chunk)}, {"$ref": _REF.format(name="ErrorResponse")}]}
    return {"anyOf": [
        {"type": "object", "properties": {"data": {"type": "string", "const": "[DONE]"}}, "required": ["data"]},
        {"type": "object", "properties": {"data": {"type": "string", "contentMediaType": "application/json",
                                                    "contentSchema": payload, "not": {"const": "[DONE]"}}},
         "required": ["data"]},
    ]}


def _generation(summary: str, request: str, response: str, chunk: str, auth: bool) -> dict:
    op = {
        "summary": summary,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": {"$ref": _REF.format(name=request)}}}},
        "responses": {
            "200": {"description": "The completion (JSON), or with stream: true a stream of Server-Sent "
                                   "Events ending with 'data: [DONE]'.",
                    "content": {"application/json": {"schema": {"$ref": _REF.format(name=response)}},
                                "text/event-stream": {"schema": _events(chunk)}}},
            **{status: _error(text) for status, text in _ERRORS.items()},
        },
    }
    if auth:
        op["security"] = [{"apiKey": []}]
    return op


def decimal_below(n: int) -> str:
    """A regex of the decimal numbers in [0, n) (leading zeros allowed), for token ids as keys."""
    digits = str(n - 1)
    branches = [f"[0-9]{{1,{len(digits) - 1}}}"] if len(digits) > 1 else []
    for i, d in enumerate(digits):
        if d != "0":
            rest = len(digits) - i - 1
            branches.append(digits[:i] + f"[0-{int(d) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    branches.append(digits)
    return "^0*(" + "|".join(branches) + ")$"


def openapi_document(model_id: str, *, vocab_size: int, api_keys: bool, stored_responses: bool = False,
                     version: str = "0.1.0") -> dict[str, Any]:
    """The OpenAPI 3.1 description of this gateway's public API (``model_id``: the served name;
    ``vocab_size``: token ids in a prompt are below it; ``stored_responses``: whether the Responses
    API's responses are stored)."""
    _, schemas = msgspec.json.schema_components(
        [CompletionRequest, ChatCompletionRequest, CompletionResponse, ChatCompletionResponse, CompletionChunk,
         ChatCompletionChunk, ModelList, ErrorResponse], ref_template=_REF)
    schemas = copy.deepcopy(schemas)
    _, structured = msgspec.json.schema_components([ResponseFormat, StructuredOutputsParams], ref_template=_REF)
    schemas.update(copy.deepcopy(structured))
    schemas.pop("StructuredOutput", None)  # the internal form of the two above, never on the wire
    schemas["StructuredOutputsParams"]["maxProperties"] = 1  # one constraint
    schemas["ResponseFormat"]["allOf"] = [_implies("type", {"const": "json_schema"}, {
        "required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}})]
    for name, rules in _REQUEST_RULES.items():
        props = schemas[name]["properties"]
        for field, rule in rules.items():
            assert field in props, f"{name}.{field}: the rule names a field the struct does not have"
            props[field] = rule
        if name in ("CompletionRequest", "ChatCompletionRequest"):
            props["model"] = {"type": "string", "enum": [model_id], "description": "The served model."}
            schemas[name]["allOf"] = _CROSS_FIELD[name]
    prompt_forms = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    for token_ids in (prompt_forms[1], prompt_forms[3]["items"]):
        token_ids["items"] = {**token_ids["items"], "maximum": vocab_size - 1}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        props["logit_bias"]["anyOf"][0]["propertyNames"] = {"pattern": decimal_below(vocab_size)}
        props["stop_token_ids"]["anyOf"][0]["items"]["maximum"] = vocab_size - 1
    for name in ("CompletionRequest", "ChatCompletionRequest"):  # (taken, not described: request_extensions.py)
        for field in UNDOCUMENTED + (("echo",) if name == "ChatCompletionRequest" else ()):
            schemas[name]["properties"].pop(field, None)
    for name, schema in _SCHEMA_RULES.items():
        schemas[name] = schema
    schemas["ChatMessage"]["allOf"] = [
        _implies("role", {"const": "tool"}, {"required": ["tool_call_id"],
                                             "properties": {"tool_call_id": {"type": "string"}}}),
        *[_implies(field, present, {"properties": {"role": {"const": "assistant"}}})
          for field, present in (("tool_calls", {"type": "array"}), ("refusal", {"type": "string"}),
                                 ("annotations", {"type": "array"}))],
        _implies("tool_call_id", {"type": "string"}, {"properties": {"role": {"const": "tool"}}}),
    ]
    for name, fields in _REQUIRED_EXTRA.items():
        schemas[name]["required"] = sorted(set(schemas[name].get("required", [])) | set(fields))
    schemas["Health"] = _HEALTH
    schemas.update({name: schema for name, schema in responses_schemas(model_id, vocab_size, _COMMON_RULES,
                                                                       stored_responses).items()
                    if name not in schemas})
    errors = {status: _error(text) for status, text in _ERRORS.items()}
    schemas.update({name: schema for name, schema in messages_schemas(model_id, _COMMON_RULES).items()
                    if name not in schemas})
    paths = {
        "/v1/completions": {"post": _generation("Text completion", "CompletionRequest", "CompletionResponse",
                                                "CompletionChunk", api_keys)},
        "/v1/chat/completions": {"post": _generation("Chat completion", "ChatCompletionRequest",
                                                     "ChatCompletionResponse", "ChatCompletionChunk", api_keys)},
        "/v1/responses": {"post": responses_operation(errors, api_keys)},
        **input_tokens_path(errors, api_keys),
        **(stored_response_paths(errors, api_keys) if stored_responses else {}),
        **(conversation_paths(errors, api_keys) if stored_responses else {}),
        **messages_paths(_ERRORS, api_keys),
        "/v1/models": {"get": {
            "summary": "The served model",
            "responses": {"200": {"description": "The one model this server serves.",
                                  "content": {"application/json": {"schema": {"$ref": _REF.format(name="ModelList")}}}},
                          "401": _error(_ERRORS["401"])},
            **({"security": [{"apiKey": []}]} if api_keys else {}),
        }},
        "/v1/models/{model}": {"get": {
            "summary": "The served model, by its id",
            "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": {"description": "The model, if it is the one this server serves.",
                                  "content": {"application/json": {"schema": {"$ref": _REF.format(name="ModelCard")}}}},
                          "401": _error(_ERRORS["401"]), "404": _error(_ERRORS["404"])},
            **({"security": [{"apiKey": []}]} if api_keys else {}),
        }},
        "/health": {"get": {
            "summary": "Serving health per pool",
            "responses": {
                "200": {"description": "Serving ('ok', or 'degraded': no prefill worker, decode workers compute "
                                       "prompts themselves).",
                        "content": {"application/json": {"schema": {"$ref": _REF.format(name="Health")}}}},
                "503": {"description": "No decode worker is healthy: nothing can generate.",
                        "content": {"application/json": {"schema": {"$ref": _REF.format(name="Health")}}}},
            },
        }},
        "/metrics": {"get": {
            "summary": "Prometheus metrics",
            "responses": {"200": {"description": "Prometheus text exposition format.",
                                  "content": {"text/plain": {"schema": {"type": "string"}}}}},
        }},
        "/openapi.json": {"get": {
            "summary": "This document",
            "responses": {"200": {"description": "OpenAPI 3.1.",
                                  "content": {"application/json": {"schema": {"type": "object"}}}}},
        }},
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "pdserve gateway", "version": version,
                 "description": "OpenAI-compatible API of a disaggregated prefill/decode LLM server."},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if api_keys:
        doc["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    return doc
