"""The request fields that constrain the output, read from the body: ``logit_bias``,
``response_format`` and vLLM's ``structured_outputs`` (their bounds, shapes and 400s naming the
field)."""
from __future__ import annotations

import json

import pytest

from gateway.openai_protocol import parse_chat_request, parse_completion_request
from tests.support.request_bodies import chat, completion, rejects


@pytest.mark.parametrize("value,text", [
    ({"x": 1}, "keys must be token ids"), ({"-1": 1}, "keys must be token ids"), ({"5": 100.5}, "in [-100, 100]"),
    ({str(i): 1 for i in range(301)}, "at most 300 entries"), ([1], "Expected `object`"),
])
def test_logit_bias_is_checked(value, text):
    rejects(parse_chat_request, chat(logit_bias=value), "logit_bias", text)


def test_response_format_and_structured_outputs_are_read():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    spec = parse_chat_request(chat(response_format=fmt)).sampling().structured
    assert (spec.kind, json.loads(spec.value), spec.field) == ("json_schema", schema, "response_format")
    assert parse_chat_request(chat(response_format={"type": "text"})).sampling().structured is None
    assert parse_completion_request(completion(response_format={"type": "json_object"})).sampling().structured.kind \
        == "json_object"
    for constraint, kind in (({"json": schema}, "json_schema"), ({"json": json.dumps(schema)}, "json_schema"),
                             ({"regex": "a+"}, "regex"), ({"choice": ["x", "y"]}, "choice"),
                             ({"grammar": 'start: "a"'}, "grammar"), ({"json_object": True}, "json_object")):
        spec = parse_chat_request(chat(structured_outputs=constraint)).sampling().structured
        assert (spec.kind, spec.field) == (kind, "structured_outputs")
    rejects(parse_chat_request, chat(response_format={"type": "json_schema"}), "response_format.json_schema",
            "needs json_schema")
    rejects(parse_chat_request, chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
            "response_format.json_schema.name", "Missing required parameter")  # (as OpenAI and vLLM)
    rejects(parse_chat_request, chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
            "response_format.json_schema.schema", "Missing required parameter")
    rejects(parse_chat_request, chat(structured_outputs={"regex": "a", "grammar": "b"}), "structured_outputs",
            "give one of")
    rejects(parse_chat_request, chat(structured_outputs={"whitespace_pattern": " "}),
            "structured_outputs.whitespace_pattern", "Unrecognized request argument")
    rejects(parse_chat_request, chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
            "structured_outputs", "send one")


def test_json_nested_past_pythons_parser_is_a_400_not_a_crash():
    deep = "[" * 5000 + "]" * 5000
    rejects(parse_chat_request, chat(structured_outputs={"json": deep}), "structured_outputs",
            "must be a JSON object")
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}
    req = parse_chat_request(chat(messages=[{"role": "user", "content": "x"},
                                            {"role": "assistant", "content": None, "tool_calls": [call]}]))
    assert req.template_messages()[1]["tool_calls"][0]["function"]["arguments"] == deep  # kept as text
