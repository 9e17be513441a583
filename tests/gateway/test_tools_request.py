"""The tools of a chat request as the chat template sees them (gateway/tools_request.py)."""
from __future__ import annotations

import json

import pytest

from gateway.openai_protocol import parse_chat_request
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
