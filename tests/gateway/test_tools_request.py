"""The tools of a chat request as the chat template sees them (gateway/tools_request.py)."""
from __future__ import annotations

import json

from gateway.openai_protocol import parse_chat_request

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
