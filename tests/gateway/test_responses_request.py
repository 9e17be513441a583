"""The Responses API's requests read into the chat path's (gateway/responses_request.py): input items
as messages, the fields mapped, what is not offered refused naming the field, and hostile lists
refused before their elements are decoded."""
from __future__ import annotations

import json

import pytest

from gateway.openai_errors import OpenAIError
from gateway.responses_request import parse_responses_request
from gateway.tools_request import NamedToolChoice
from tests.support.request_bodies import many, refuses_naming, rejects_lightly, with_fields



def parse(**body):
    return parse_responses_request(json.dumps({"model": "m", **body}).encode())


def roles(call) -> list[tuple]:
    return [(m.role, m.content, [(c.id, c.function.name) for c in m.tool_calls or ()], m.tool_call_id)
            for m in call.chat.messages]


def test_a_string_input_is_a_user_message_after_the_instructions():
    assert roles(parse(input="hi")) == [("user", "hi", [], None)]
    assert roles(parse(input="hi", instructions="Be brief.")) == [("system", "Be brief.", [], None),
                                                                   ("user", "hi", [], None)]


def test_items_become_the_chat_messages():
    call = parse(input=[
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "let me see", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc_1"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "7"}]},
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
    ])
    assert roles(call) == [
        ("developer", "rules", [], None),
        ("user", "a\nb", [], None),  # parts a line apart, as vLLM's
        ("assistant", "let me see", [("c1", "f"), ("c2", "g")], None),  # the text and the calls after it: one turn
        ("tool", "42", [], "c1"),
        ("tool", "7", [], "c2"),
        ("assistant", None, [("c3", "f")], None),  # after a tool result: a turn of its own
        ("assistant", "no", [], None),
    ]


def test_a_function_call_output_must_answer_a_call_made_before_it():
    """OpenAI's API: a 400 naming the call_id where no function call before the output has it -- in
    the input, or in the history the call continues."""
    output = {"type": "function_call_output", "call_id": "c9", "output": "42"}
    call = {"type": "function_call", "call_id": "c9", "name": "f", "arguments": "{}"}
    assert parse(input=[call, output]).check_call_outputs()
    for alone in ([output], [output, call]):
        with pytest.raises(OpenAIError, match="No tool call found for function call output with call_id c9") as error:
            parse(input=alone).check_call_outputs()
        assert error.value.param == "input"
    history = parse(input=[{"role": "user", "content": "hi"}, call]).chat.messages
    assert parse(input=[output]).continuing(history).check_call_outputs()


def test_the_fields_map_onto_the_chat_request():
    call = parse(input="x", max_output_tokens=7, temperature=0.5, top_p=0.9, top_logprobs=2,
                 include=["message.output_text.logprobs"], parallel_tool_calls=False, metadata={"k": "v"},
                 tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                 tool_choice={"type": "function", "name": "f"}, seed=3, top_k=5, stop=["END"])
    chat, options = call.chat, call.chat.sampling()
    assert (options.max_tokens, options.temperature, options.top_p, options.logprobs, options.seed, options.top_k,
            options.stop) == (7, 0.5, 0.9, 2, 3, 5, ("END",))
    assert chat.tool_choice == NamedToolChoice("function", chat.tool_choice.function)
    assert chat.tool_choice.function.name == "f" and chat.parallel_tool_calls is False
    assert chat.tools[0].function.name == "f"
    assert call.tools == [{"type": "function", "name": "f", "description": None, "parameters": {"type": "object"},
                           "strict": None}]
    assert call.tool_choice == {"type": "function", "name": "f"} and call.metadata == {"k": "v"}
    assert parse(input="x").chat.sampling().logprobs is None
    assert parse(input="x", include=["message.output_text.logprobs"]).chat.sampling().logprobs == 0
    assert parse(input="x", tools=[{"type": "function", "name": "f"}]).tool_choice == "auto"


def test_text_format_constrains_the_output():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    call = parse(input="x", text={"format": {"type": "json_schema", "name": "r", "schema": schema}})
    structured = call.chat.sampling().structured
    assert (structured.kind, json.loads(structured.value), structured.field) == ("json_schema", schema, "text.format")
    assert parse(input="x", text={"format": {"type": "json_object"}}).chat.sampling().structured.kind == "json_object"
    assert parse(input="x", text={"format": {"type": "text"}}).chat.sampling().structured is None
    assert call.text == {"format": {"type": "json_schema", "name": "r", "schema": schema, "strict": None,
                                    "description": None}}


@pytest.mark.parametrize("body, param, code", [
    ({"store": "yes"}, "store", None),
    ({"background": True, "store": False}, "store", "unsupported_value"),
    ({"previous_response_id": "r" * 65}, "previous_response_id", None),
    ({"conversation": "conv_1", "previous_response_id": "resp_1"}, "conversation", "unsupported_value"),
    ({"conversation": {"name": "conv_1"}}, "conversation.name", None),
    ({"conversation": "c" * 65}, "conversation", None),
    ({"input": []}, "input", None),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", None),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", None),
    ({"input": [{"role": "user"}]}, "input[0].content", "missing_required_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]",
     "unsupported_value"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0]", None),
    ({"input": [{"type": "web_search_call", "id": "ws"}]}, "input[0].type", "unsupported_value"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments",
     "missing_required_parameter"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "bad name", "arguments": "{}"}]}, "input[0].name",
     "invalid_value"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", "missing_required_parameter"),
    ({"tools": [{"type": "file_search"}]}, "tools[0].type", "invalid_value"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]}, "tools", "invalid_tools"),
    ({"tool_choice": "required"}, "tool_choice", None),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice.type", "invalid_value"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "tool_choice", None),
    ({"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}}, "structured_outputs", None),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name", None),
    ({"top_logprobs": 3}, "top_logprobs", None),
    ({"include": ["file_search_call.results"]}, "include[0]", "invalid_value"),
    ({"truncation": "auto"}, "truncation", "invalid_value"),
    ({"n": 2}, "n", "unknown_parameter"),
    ({"top_k": -5}, "top_k", None),
])
def test_what_is_not_offered_is_refused_naming_the_field(body, param, code):
    body.setdefault("input", "x")
    refuses_naming(parse, body, param, code)


def test_a_continued_response_comes_after_the_instructions_and_before_the_input():
    history = parse(input=[{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}]).chat.messages
    call = parse(input="three", instructions="Be brief.", previous_response_id="resp_" + "0" * 32)
    assert (call.previous_response_id, call.store) == ("resp_" + "0" * 32, None)
    assert roles(call.continuing(history)) == [("system", "Be brief.", [], None), ("user", "one", [], None),
                                               ("assistant", "two", [], None), ("user", "three", [], None)]
    assert roles(parse(input="three").continuing(history))[0] == ("user", "one", [], None)
    assert [m.content for m in call.input_messages] == ["three"]
    assert parse(input="x", store=False).store is False and parse(input="x", store=True).store is True
    in_conversation = parse(input="three", conversation="conv_1").continuing(history, "conversation")
    assert [m.content for m in in_conversation.turns] == ["three"]  # it keeps its input: the conversation the rest
    assert len(in_conversation.chat.messages) == len(history) + 1
    assert parse(input="x", conversation="conv_1").conversation_id == parse(
        input="x", conversation={"id": "conv_1"}).conversation_id == "conv_1"
    # an empty input continues a conversation as it stands
    assert roles(parse(input=[], previous_response_id="resp_" + "0" * 32).continuing(history))[-1][1] == "two"


def test_a_count_may_leave_the_model_and_the_input_out():
    count = parse_responses_request(json.dumps({"instructions": "Be brief."}).encode(), counting_for="served")
    assert (count.chat.model, roles(count)) == ("served", [("system", "Be brief.", [], None)])
    assert roles(parse_responses_request(b'{"input": "hi"}', counting_for="served")) == [("user", "hi", [], None)]
    refuses_naming(parse, {"instructions": "x"}, "input", "missing_required_parameter")  # a response needs its input


def test_a_continued_conversation_is_bounded_as_a_sent_one():
    from gateway.openai_protocol import MAX_MESSAGES

    history = parse(input="x").chat.messages * MAX_MESSAGES
    refuses_naming(lambda **body: parse(**body).continuing(history), {"input": "one more"}, "previous_response_id",
                   None)


PART = b'{"type": "input_text", "text": "x"}'
# 38 parts an item: the parts of the first 108 items are more than 4096 in all.
SPREAD = b"[" + b",".join([b'{"role": "user", "content": [' + b",".join([PART] * 38) + b"]}"] * 2500) + b"]"


@pytest.mark.parametrize("field, value, param, text", [
    ("input", many(b'{"role": "user", "content": ""}'), "input", "at most length 4096"),
    ("input", b'[{"role": "user", "content": ' + many(PART) + b"}]", "input[0].content", "at most length 64"),
    ("input", SPREAD, "input[107]", "at most 4096 content parts in all"),
    ("tools", many(b'{"type": "function", "name": "f"}'), "tools", "at most 262144 are allowed"),
    ("text", b'{"format": {"type": "json_schema", "name": "r", "schema": ' + many(b"1") + b"}}", "text",
     "at most 262144 are allowed"),
    ("stop", many(b'"ab"'), "stop", "at most length 16"),
    ("metadata", b"{" + b",".join(b'"k%d": "v"' % i for i in range(200_000)) + b"}", "metadata",
     "at most 131072 are allowed (16 pairs)"),
])
def test_hostile_lists_are_refused_before_their_elements_are_decoded(field, value, param, text):
    rejects_lightly(parse_responses_request, with_fields({"model": b'"m"', "input": b'"x"', field: value}), param, text,
                    field)
