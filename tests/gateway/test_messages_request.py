"""Anthropic's Messages API requests read into the chat path's (gateway/messages_request.py): turns and
blocks as messages, the fields mapped, what is not offered refused naming the field, and hostile
lists refused before their elements are decoded."""
from __future__ import annotations

import json

import pytest

from gateway.messages_output import tool_input
from gateway.messages_request import parse_messages_request
from gateway.openai_protocol import OpenAIError
from tests.support.request_bodies import many, refuses_naming, rejects_lightly, with_fields



def parse(counting: bool = False, **body):
    body.setdefault("max_tokens", 16)
    return parse_messages_request(json.dumps({"model": "m", **body}).encode(), counting=counting)


def messages(call) -> list[tuple]:
    return [(m.role, m.content, [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ()],
             m.tool_call_id) for m in call.messages]


def test_turns_and_blocks_become_the_chat_messages():
    call = parse(system=[{"type": "text", "text": "rules "}, {"type": "text", "text": "apply"}], messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "s"},
            {"type": "text", "text": "let me see"},
            {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": [1, 2]}},
            {"type": "tool_use", "id": "toolu_2", "name": "g", "input": {}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "first"}, {"type": "text", "text": "then", "cache_control": {"type": "ephemeral"}},
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "7"},
                                                                            {"type": "text", "text": "8"}],
             "is_error": True},
            {"type": "text", "text": "and now?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_3", "name": "f", "input": {}}]},
    ])
    assert messages(call) == [
        ("system", "rules apply", [], None),  # system blocks run on; a turn's text blocks a line apart (vLLM's)
        ("user", "hi", [], None),
        ("assistant", "let me see", [("toolu_1", "f", '{"a": [1, 2]}'), ("toolu_2", "g", "{}")], None),
        ("user", "first\nthen", [], None),  # the text before a result stays before it
        ("tool", "42", [], "toolu_1"),
        ("tool", "Error: 7\n8", [], "toolu_2"),  # a failed tool's result says so
        ("user", "and now?", [], None),
        ("assistant", None, [("toolu_3", "f", "{}")], None),  # calls alone: no content
    ]


def test_the_fields_map_onto_the_chat_request():
    call = parse(messages=[{"role": "user", "content": "x"}], max_tokens=7, temperature=0.5, top_p=0.9, top_k=4,
                 stop_sequences=["END"], metadata={"user_id": "u1"}, stream=True, seed=3,
                 tools=[{"name": "f", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}],
                 tool_choice={"type": "any", "disable_parallel_tool_use": True})
    chat, options = call, call.sampling()
    assert (options.max_tokens, options.temperature, options.top_p, options.top_k, options.stop, options.seed,
            options.stream) == (7, 0.5, 0.9, 4, ("END",), 3, True)
    assert (chat.tool_choice, chat.parallel_tool_calls, chat.user) == ("required", False, "u1")
    assert chat.tools[0].function.parameters == {"type": "object"}
    named = parse(messages=[{"role": "user", "content": "x"}], tools=[{"name": "f", "input_schema": {}}],
                  tool_choice={"type": "tool", "name": "f"})
    assert named.tool_choice.function.name == "f" and named.parallel_tool_calls is True
    assert parse(messages=[{"role": "user", "content": "x"}], top_k=0).sampling().top_k is None
    for tier in ("auto", "standard_only"):  # (Anthropic's; one tier here)
        assert parse(messages=[{"role": "user", "content": "x"}], service_tier=tier).max_completion_tokens
    schema = {"type": "object"}
    structured = parse(messages=[{"role": "user", "content": "x"}],
                       output_config={"format": {"type": "json_schema", "schema": schema}}).sampling().structured
    assert (structured.kind, json.loads(structured.value), structured.field) == ("json_schema", schema,
                                                                                 "output_config.format")


def test_count_tokens_needs_no_max_tokens():
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()
    assert parse_messages_request(body, counting=True).max_completion_tokens is None
    with pytest.raises(OpenAIError) as info:
        parse_messages_request(body)
    assert info.value.param == "max_tokens"


def test_a_calls_input_is_its_object_or_empty_where_cut_short():
    assert tool_input('{"a": 1}') == {"a": 1}
    assert tool_input('{"a": ') == {} and tool_input("[1]") == {}


@pytest.mark.parametrize("body, param, code", [
    ({"messages": []}, "messages", None),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type",
     "unsupported_value"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text",
     "missing_required_parameter"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]},
     "messages[0].content[0].id", "missing_required_parameter"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}]},
     "messages[0].content[0].input", None),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id", "missing_required_parameter"),
    ({"system": [{"type": "image"}]}, "system[0].type", "unsupported_value"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type", "invalid_value"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema", "missing_required_parameter"),
    ({"tools": [{"name": "f", "input_schema": {}}, {"name": "f", "input_schema": {}}]}, "tools", "invalid_tools"),
    ({"tool_choice": {"type": "any"}}, "tool_choice", None),
    ({"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool"}}, "tool_choice.name",
     "missing_required_parameter"),
    ({"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "any"},
      "output_config": {"format": {"type": "json_schema", "schema": {}}}}, "tool_choice", None),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.type", "invalid_value"),
    ({"output_config": {"effort": "high"}}, "output_config.effort", "unknown_parameter"),
    ({"temperature": 1.5}, "temperature", "invalid_value"),
    ({"service_tier": "priority"}, "service_tier", "invalid_value"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"stop_sequences": ["ok", ""]}, "stop_sequences", None),
    ({"stop_sequences": "END"}, "stop_sequences", None),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The"}],
      "output_config": {"format": {"type": "json_schema", "schema": {}}}}, "messages", None),
    # as Anthropic's API: a prefill may not end in whitespace
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The "}]}, "messages", None),
    ({"cache_control": {"type": "permanent"}}, "cache_control.type", "invalid_value"),
])
def test_what_is_not_offered_is_refused_naming_the_field(body, param, code):
    body.setdefault("messages", [{"role": "user", "content": "x"}])
    refuses_naming(parse, body, param, code)


def test_a_tool_choice_without_tools_is_refused_by_its_own_name_and_caching_hints_are_taken():
    for kind in ("any", "auto", "tool"):
        with pytest.raises(OpenAIError, match=f"^tool_choice '{kind}' needs tools"):
            parse(messages=[{"role": "user", "content": "x"}], tool_choice={"type": kind, "name": "f"})
    assert parse(messages=[{"role": "user", "content": "x"}], tool_choice={"type": "none"}).tool_plan().mode == "none"
    # automatic prompt caching (the official client's cache_control): every prefix is cached here anyway
    hinted = parse(messages=[{"role": "user", "content": "x"}], cache_control={"type": "ephemeral", "ttl": "1h"})
    assert hinted.messages[-1].content == "x"


BLOCK = b'{"type": "text", "text": "x"}'
# 38 blocks a turn: the blocks of the first 108 turns are more than 4096 in all.
SPREAD = b"[" + b",".join([b'{"role": "user", "content": [' + b",".join([BLOCK] * 38) + b"]}"] * 2500) + b"]"


@pytest.mark.parametrize("field, value, param, text", [
    ("messages", many(b'{"role": "user", "content": ""}'), "messages", "at most length 4096"),
    ("messages", b'[{"role": "user", "content": ' + many(BLOCK) + b"}]", "messages[0].content", "at most length 64"),
    ("messages", SPREAD, "messages[107].content", "at most 4096 content blocks in all"),
    ("system", many(BLOCK), "system", "at most length 64"),
    ("tools", many(b'{"name": "f", "input_schema": {}}'), "tools", "at most 262144 are allowed"),
    ("stop_sequences", many(b'"ab"'), "stop_sequences", "at most length 16"),
])
def test_hostile_lists_are_refused_before_their_elements_are_decoded(field, value, param, text):
    fields = {"model": b'"m"', "max_tokens": b"8", "messages": b'[{"role": "user", "content": "x"}]', field: value}
    rejects_lightly(parse_messages_request, with_fields(fields), param, text, field)
