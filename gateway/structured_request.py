"""The request fields that constrain the output, read into one ``StructuredOutput``.

    response_format      {"type": "text"}                                  no constraint
                         {"type": "json_object"}                           any JSON object
                         {"type": "json_schema", "json_schema": {"name", "schema", "strict",
                          "description"}}                                  the schema (strict or not:
                                                                           enforced either way)
    structured_outputs   vLLM's: exactly one of {"json": schema, "regex", "choice": [...],
                         "grammar": Lark or GBNF, "json_object": true}

Each is read from the body's raw JSON only once its size is within ``MAX_GRAMMAR_CHARS`` (no
object is built for a larger one), and the two may not both constrain a request.  The grammar
itself is compiled (and refused with a 400 naming the field) by ``GrammarCompiler``.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec

from common.engine.structured.spec import MAX_CHOICES, MAX_GRAMMAR_CHARS, StructuredOutput
from gateway.openai_errors import invalid


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str  # required, as in OpenAI's API and vLLM's
    schema: dict[str, Any] | bool
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's ``structured_outputs`` (the constraint fields; its backend-tuning fields are refused)."""

    json: dict[str, Any] | bool | str | None = None  # a schema, or its JSON text
    regex: str | None = None
    choice: Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]],
                      msgspec.Meta(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def grammar_json(raw: msgspec.Raw, field: str) -> msgspec.Raw:
    """A grammar-bearing field's JSON (a schema, tools), refused past ``MAX_GRAMMAR_CHARS`` before it
    is decoded."""
    if len(raw) > MAX_GRAMMAR_CHARS:
        raise invalid(f"{field} is {len(raw)} bytes of JSON; at most {MAX_GRAMMAR_CHARS} are allowed", field)
    return raw


def _decode(raw: msgspec.Raw, kind: type, field: str, from_msgspec):
    grammar_json(raw, field)
    try:
        return msgspec.json.decode(raw, type=kind, strict=False)
    except msgspec.MsgspecError as exc:
        raise from_msgspec(exc, field) from None


def read_response_format(raw: msgspec.Raw, from_msgspec) -> StructuredOutput | None:
    fmt = _decode(raw, ResponseFormat, "response_format", from_msgspec)
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput("json_object", "", "response_format")
    if fmt.json_schema is None:
        raise invalid("response_format: type json_schema needs json_schema", "response_format.json_schema")
    return _schema(fmt.json_schema.schema, "response_format")


def read_structured_outputs(raw: msgspec.Raw, from_msgspec) -> StructuredOutput | None:
    so = _decode(raw, StructuredOutputsParams, "structured_outputs", from_msgspec)
    given = [name for name in ("json", "regex", "choice", "grammar") if getattr(so, name) is not None]
    if so.json_object:
        given.append("json_object")
    if len(given) > 1:
        raise invalid(f"structured_outputs: give one of json, regex, choice, grammar, json_object; got "
                      f"{', '.join(given)}", "structured_outputs")
    if not given:
        return None
    kind = given[0]
    if kind == "json":
        return _schema(json.loads(so.json) if isinstance(so.json, str) and _is_json(so.json) else so.json,
                       "structured_outputs")
    if kind == "json_object":
        return StructuredOutput("json_object", "", "structured_outputs")
    if kind == "choice":
        return StructuredOutput("choice", json.dumps(so.choice), "structured_outputs")
    return StructuredOutput(kind, getattr(so, kind), "structured_outputs")


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):  # nested too deeply for Python's parser: not a schema we read
        return False
    return True


def _schema(schema: Any, field: str) -> StructuredOutput:
    if not isinstance(schema, (dict, bool)):
        raise invalid(f"{field}: the JSON schema must be a JSON object", field, "invalid_grammar")
    return StructuredOutput("json_schema", schema_text(schema, field), field)


def schema_text(schema: Any, field: str) -> str:
    """``schema`` as JSON text; one nested past Python's own limit is a 400 naming ``field``."""
    try:
        return json.dumps(schema)
    except RecursionError:
        raise invalid(f"{field}: the JSON schema is nested too deeply", field, "invalid_grammar") from None
