"""Tool calls read from text (the parsers) and streamed (``ToolOutput``): a stream, however its text
is cut into deltas, sends the content and the calls the whole answer has."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from gateway.tool_output import ToolOutput
from gateway.tool_parsers import HermesParser, JsonParser, Llama3JsonParser, ParsedCall
from gateway.tools_request import FunctionDefinition, NamedFunction, NamedToolChoice, Tool, plan_tools

NAMES = frozenset({"get_weather", "get_time"})
TOOLS = tuple(Tool(type="function", function=FunctionDefinition(name=n)) for n in sorted(NAMES))


def test_hermes():
    text = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n' \
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert HermesParser().parse(text, NAMES) == (
        "Sure.", [ParsedCall("get_weather", '{"city": "Oslo"}'), ParsedCall("get_time", "{}")])
    # an unknown function or bad JSON stays text; an unclosed last call is read
    assert HermesParser().parse('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', NAMES)[1] == []
    assert HermesParser().parse("<tool_call>{oops</tool_call>", NAMES) == ("<tool_call>{oops</tool_call>", [])
    assert HermesParser().parse('<tool_call>{"name": "get_time", "arguments": {}}', NAMES) == (
        None, [ParsedCall("get_time", "{}")])
    assert HermesParser().parse("just words", NAMES) == ("just words", [])
    # cut short (max_tokens, a stop string) in a call: the call so far, where its name is whole; its
    # markup is never content (it was, raw)
    content, calls = HermesParser().parse('Sure. <tool_call>{"name": "get_weather", "arguments": {"city', NAMES)
    assert (content, calls) == ("Sure.", [ParsedCall("get_weather", '{"city')]) and calls[0].cut
    assert HermesParser().parse('Sure. <tool_call>{"name": "get_wea', NAMES) == ("Sure.", [])
    unknown = 'Sure. <tool_call>{"name": "rm", "arguments": {'  # an unknown function's: text, as a whole one's
    assert HermesParser().parse(unknown, NAMES) == (unknown, [])


def test_llama3_and_json():
    text = '<|python_tag|>{"name": "get_time", "parameters": {"zone": "utc"}}; {"name": "get_weather", "parameters": {}}'
    assert Llama3JsonParser().parse(text, NAMES) == (
        None, [ParsedCall("get_time", '{"zone": "utc"}'), ParsedCall("get_weather", "{}")])
    assert JsonParser().parse('[{"name": "get_time", "arguments": "{\\"zone\\": \\"cet\\"}"}]', NAMES) == (
        None, [ParsedCall("get_time", '{"zone": "cet"}')])
    assert JsonParser().parse('{"name": "nope", "arguments": {}}', NAMES)[1] == []
    assert JsonParser().parse("{not json", NAMES) == ("{not json", [])
    assert JsonParser().parse("plain answer", NAMES) == ("plain answer", [])
    # cut short: the calls whole in it, then the one it was cut in (where its name is whole); JSON of
    # anything else, cut short, stays text
    cut = '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city'
    content, calls = Llama3JsonParser().parse(cut, NAMES)
    assert (content, calls) == (None, [ParsedCall("get_time", "{}"), ParsedCall("get_weather", '{"city')])
    assert [c.cut for c in calls] == [False, True]
    assert JsonParser().parse('[{"name": "get_time", "arguments": {}}, {"name": "get_we', NAMES) == (
        None, [ParsedCall("get_time", "{}")])
    for text in ('{"answer": "the city is', '{"name": "rm", "arguments": {', '[{"x": 1}, {"name": "get_time", "arg'):
        assert JsonParser().parse(text, NAMES) == (text, [])


def stream(output: ToolOutput, pieces: list[str]):
    deltas = [d for p in pieces for d in output.step(p)] + output.finish()
    content = "".join(d.content or "" for d in deltas) or None
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.tool_calls or []:
            entry = calls.setdefault(c.index, {"name": None, "arguments": ""})
            if c.id is not None:
                assert entry["name"] is None, "one start per call"
                entry["name"] = c.function.name
            entry["arguments"] += c.function.arguments or ""
    return content, [ParsedCall(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]


def cuts(text: str):
    return st.lists(st.integers(0, len(text)), max_size=12).map(
        lambda points: [text[a:b] for a, b in zip([0, *sorted(points)], [*sorted(points), len(text)])])


HERMES_TEXTS = [
    '  Let me look. <tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call> ',
    'A<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>B<tool_call>{"name": "get_time", '
    '"arguments": {}}</tool_call>C',
    "no calls at all, but a < and <tool",
    "<tool_call>broken</tool_call> tail",
    'Sure. <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>\n<tool_call>{"name": "get_time", '
    '"arguments": {"zone": "u',  # cut short in its second call
]


REQUIRED = '[{"name": "get_time", "parameters": {"zone": "utc"}}, {"name": "get_weather", "parameters": {"a": [1, "}"]}}]'


@settings(max_examples=60, deadline=None)
@given(cuts(REQUIRED))
def test_required_streams_each_call_once_complete(pieces):
    plan = plan_tools(TOOLS, "required", True)
    output = ToolOutput(plan, HermesParser())
    assert stream(output, pieces) == ToolOutput(plan, HermesParser()).final(REQUIRED) == (
        None, [ParsedCall("get_time", '{"zone":"utc"}'), ParsedCall("get_weather", '{"a":[1,"}"]}')])  # compact


@settings(max_examples=30, deadline=None)
@given(cuts('{"zone": "cet"}'))
def test_named_streams_argument_fragments(pieces):
    plan = plan_tools(TOOLS, NamedToolChoice("function", NamedFunction("get_time")), True)
    assert stream(ToolOutput(plan, HermesParser()), pieces) == (None, [ParsedCall("get_time", '{"zone": "cet"}')])


@settings(max_examples=80, deadline=None)
@given(st.integers(0, len(REQUIRED)).flatmap(lambda n: cuts(REQUIRED[:n])))
def test_required_cut_anywhere_streams_what_the_whole_answer_holds(pieces):
    plan = plan_tools(TOOLS, "required", True)
    text = "".join(pieces)
    assert stream(ToolOutput(plan, HermesParser()), pieces) == ToolOutput(plan, HermesParser()).final(text)


def test_required_schema_lists_every_tool():
    plan = plan_tools(TOOLS, "required", False)
    schema = json.loads(plan.structured.value)
    assert schema["maxItems"] == 1 and {i["properties"]["name"]["const"] for i in schema["items"]["anyOf"]} == NAMES


def test_required_cut_short_keeps_the_calls_complete_in_it_and_the_one_it_was_cut_in():
    plan = plan_tools(TOOLS, "required", True)
    cut = REQUIRED[:REQUIRED.index("get_weather") + 20]
    whole = ToolOutput(plan, HermesParser()).final(cut)
    assert whole == (None, [ParsedCall("get_time", '{"zone":"utc"}'), ParsedCall("get_weather", "")])
    assert stream(ToolOutput(plan, HermesParser()), [cut[:10], cut[10:]]) == whole
    inside = REQUIRED[:REQUIRED.index("[1,") + 3]  # (in its arguments: they go out as far as they came)
    assert ToolOutput(plan, HermesParser()).final(inside)[1][-1] == ParsedCall("get_weather", '{"a": [1,')
    # cut before a call's name is complete: no call, and the array's text is no answer (it is the grammar's)
    bad_escape = '[{"name": "get_\\qtime", "param'  # (no JSON string: no call)
    assert ToolOutput(plan, HermesParser()).final(bad_escape) == (None, [])
    assert ToolOutput(plan, HermesParser()).final(' [{"name": "get_t') == (None, [])
    assert stream(ToolOutput(plan, HermesParser()), [' [{"name"', ': "get_t ']) == (None, [])


def test_text_nested_past_pythons_parser_is_no_call():
    deep = "[" * 5000
    assert HermesParser().parse(f"<tool_call>{deep}</tool_call>", NAMES)[1] == []
    assert JsonParser().parse(deep, NAMES) == (deep, [])
    plan = plan_tools(TOOLS, "required", True)
    assert ToolOutput(plan, HermesParser()).final("[{" + deep) == (None, [])


JSON_TEXTS = [
    '<|python_tag|>{"name": "get_time", "parameters": {"zone": "utc"}}; {"name": "get_weather", "parameters": {}}',
    '  {"name": "get_time", "parameters": {}}',
    "Just an answer, no call.  ",
    "<|python_tag|> not json",
    '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"ci',  # cut short
]
CASES = [(HermesParser, text) for text in HERMES_TEXTS] + [(Llama3JsonParser, text) for text in JSON_TEXTS]


@settings(max_examples=120, deadline=None)
@given(st.sampled_from(CASES).flatmap(lambda c: st.tuples(st.just(c), cuts(c[1]))))
def test_auto_streams_what_the_whole_answer_holds(case):
    (parser, text), pieces = case
    plan = plan_tools(TOOLS, "auto", True)
    assert stream(ToolOutput(plan, parser()), pieces) == ToolOutput(plan, parser()).final(text)


@settings(max_examples=40, deadline=None)
@given(cuts(HERMES_TEXTS[1]))
def test_auto_without_parallel_calls_answers_the_first_call_alone_whole_or_streamed(pieces):
    """The model wrote two calls (auto's text is free); ``parallel_tool_calls`` false: the first
    alone, as OpenAI's API and vLLM answer."""
    plan = plan_tools(TOOLS, "auto", False)
    content, calls = ToolOutput(plan, HermesParser()).final(HERMES_TEXTS[1])
    assert [c.name for c in calls] == ["get_weather"]
    assert stream(ToolOutput(plan, HermesParser()), pieces) == (content, calls)
    assert len(ToolOutput(plan_tools(TOOLS, "auto", True), HermesParser()).final(HERMES_TEXTS[1])[1]) == 2


@pytest.mark.parametrize("mode, finish, expected", [
    ("named", "stop", "stop"),  # OpenAI's API and vLLM: a named function's call ends stop
    ("required", "stop", "tool_calls"), ("auto", "stop", "tool_calls"), ("required", "length", "length")])
def test_an_answer_of_calls_ends_tool_calls_unless_the_function_was_named(mode, finish, expected):
    plan = plan_tools(TOOLS, NamedToolChoice("function", NamedFunction("get_time")) if mode == "named" else mode, True)
    output = ToolOutput(plan, HermesParser())
    assert output.finish_reason(True, finish) == expected and output.finish_reason(False, "stop") == "stop"


@pytest.mark.parametrize("stop_reason", ["llo", 7])
def test_required_calls_cut_by_a_stop_string_or_token_end_stop(stop_reason):
    """A stop string (or stop_token_ids token) cut ``required``'s array inside a call: ``stop``, not
    ``tool_calls`` -- its last call's arguments are not whole; so does ``auto``'s answer cut in a call
    (it ended ``tool_calls``), whole or streamed, and ``auto``'s calls all whole end ``tool_calls``."""
    required = ToolOutput(plan_tools(TOOLS, "required", True), HermesParser())
    assert required.finish_reason(True, "stop", stop_reason) == "stop"
    assert required.finish_reason(True, "stop", None) == "tool_calls"
    for text, expected in ((HERMES_TEXTS[0], "tool_calls"), (HERMES_TEXTS[-1], "stop")):
        whole, streamed = (ToolOutput(plan_tools(TOOLS, "auto", True), HermesParser()) for _ in range(2))
        whole.final(text)
        stream(streamed, [text])
        assert whole.finish_reason(True, "stop", stop_reason) == streamed.finish_reason(True, "stop", stop_reason) \
            == expected
