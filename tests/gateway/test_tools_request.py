"""The tools of a chat request as the chat template sees them (gateway/tools_request.py)."""
from __future__ import annotations

import json

import pytest

from gateway.messages_request import parse_messages_request
from gateway.openai_protocol import OpenAIError, parse_chat_request
from gateway.responses_request import parse_responses_request
from gateway.tools_request import FunctionDefinition, NamedFunction, NamedToolChoice, Tool, plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def template_tools(*tools: dict) -> list[dict]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": list(tools)}
    return parse_chat_request(json.dumps(body).encode()).tool_plan().template_tools()


def test_a_tool_reaches_the_template_as_sent_with_no_field_it_did_not_send():
    assert template_tools(WEATHER) == [WEATHER]  # no "strict": null (it changed the prompt: 4 more tokens)
    bare = {"type": "function", "function": {"name": "ping"}}
    assert template_tools(bare) == [bare]
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": False}}
    assert template_tools(strict) == [strict]


@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize("sent, grammar", [
    (None, {"type": "object", "properties": {}, "additionalProperties": False}),
    ({}, {"type": "object"}),  # an empty schema constrains nothing: any object (it was taken for none)
])
def test_a_function_sent_without_parameters_takes_none(choice, sent, grammar):
    """OpenAI's API: omitted ``parameters`` define an empty parameter list -- the grammar allows
    ``{}`` alone (it allowed any object: a base model rambled until max_tokens)."""
    bare = (Tool(type="function", function=FunctionDefinition(name="f", parameters=sent)),)
    plan = plan_tools(bare, NamedToolChoice("function", NamedFunction("f")) if choice == "named" else choice, True)
    schema = json.loads(plan.structured.value)
    parameters = schema if choice == "named" else schema["items"]["properties"]["parameters"]
    assert parameters == grammar


@pytest.mark.parametrize("choice", ["auto", "none", "required"])
def test_a_functions_parameters_must_be_an_object_schema_whatever_the_choice(choice):
    """As OpenAI's API (the schema was looked at only where a call was forced)."""
    for kind in ("string", "objectx", ["string", "null"]):
        bad = {"type": "function", "function": {"name": "f", "parameters": {"type": kind}}}
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [bad], "tool_choice": choice}
        with pytest.raises(OpenAIError) as info:
            parse_chat_request(json.dumps(body).encode())
        assert (info.value.param, info.value.code) == ("tools[0].function.parameters", "invalid_tools")
        assert f"got type {kind!r}" in info.value.message
    flat = {"model": "m", "input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]}
    with pytest.raises(OpenAIError, match=r"^tools\[0\]\.parameters: "):
        parse_responses_request(json.dumps(flat).encode())
    anthropic = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                 "tools": [{"name": "f", "input_schema": {"type": "string"}}]}
    with pytest.raises(OpenAIError, match=r"^tools\[0\]\.input_schema: "):
        parse_messages_request(json.dumps(anthropic).encode())
    for fine in ({"type": "object"}, {"type": ["object", "null"]}, {}, {"properties": {"a": {"type": "string"}}}):
        tool = {"type": "function", "function": {"name": "f", "parameters": fine}}
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool], "tool_choice": choice}
        assert parse_chat_request(json.dumps(body).encode()).tool_plan().tools[0].function.parameters == fine
