"""OpenAI's Responses API served (``client.responses``): a real gateway, prefill and decode workers,
Redis and the official openai client.  A response is the chat path's answer in another shape: its
text, tokens, usage and logprobs equal a chat completion's of the same conversation (greedy); a
stream's events come in the documented order, numbered, and reassemble to the whole response; tool
calls are ``function_call`` items valid by their schemas (streamed, the same), and go back as
``function_call`` / ``function_call_output`` input items on the next turn; ``text.format``
constrains the text; what is not offered (images, built-in tools, an unstored background run) is a 400
naming the field (stored responses: tests/serving/test_stored_responses_serving.py)."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.support.checkpoints import TRAINING_TEXT

pytestmark = pytest.mark.slow(seconds=14)  # a long file: scheduled by its length (tests/conftest.py)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
         {"type": "function", "name": "get_time",
          "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
                         "additionalProperties": False}}]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
LONG = "Responses: " + " ".join(TRAINING_TEXT) * 2  # over --skip-prefill-below: the prefill worker samples first
HERMES = ('Let me check\\. <tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "[a-z]{1,5}", '
          '"unit": "c"\\}\\}\\n</tool_call>')


def chat(client, stack, messages, **params):
    return client.chat.completions.create(model=stack.model_name, messages=messages, **params)


def respond(client, stack, input, **params):
    return client.responses.create(model=stack.model_name, input=input, **params)


def events_of(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    return events


def reassembled(events) -> list[dict]:
    """The output items as the deltas built them, checked against each item's .done events."""
    items: dict[int, dict] = {}
    for e in events:
        if e.type == "response.output_item.added":
            item = e.item
            items[e.output_index] = ({"type": "message", "text": ""} if item.type == "message" else
                                     {"type": "function_call", "name": item.name, "call_id": item.call_id,
                                      "arguments": ""})
        elif e.type == "response.output_text.delta":
            items[e.output_index]["text"] += e.delta
        elif e.type == "response.function_call_arguments.delta":
            items[e.output_index]["arguments"] += e.delta
        elif e.type == "response.output_text.done":
            assert e.text == items[e.output_index]["text"]
        elif e.type == "response.function_call_arguments.done":
            assert e.arguments == items[e.output_index]["arguments"]
        elif e.type == "response.output_item.done":
            done = e.item
            assert done.status in ("completed", "incomplete")
            items[e.output_index]["status"] = done.status
            if done.type == "message":
                assert done.content[0].text == items[e.output_index]["text"]
            else:
                assert (done.name, done.call_id, done.arguments) == (items[e.output_index]["name"],
                                                                     items[e.output_index]["call_id"],
                                                                     items[e.output_index]["arguments"])
    return [items[i] for i in sorted(items)]


def summary(response) -> list[dict]:
    """A whole response's output items, as ``reassembled`` gives a stream's."""
    out = []
    for item in response.output:
        if item.type == "message":
            out.append({"type": "message", "text": item.content[0].text, "status": item.status})
        else:
            out.append({"type": "function_call", "name": item.name, "call_id": item.call_id,
                        "arguments": item.arguments, "status": item.status})
    return out


@pytest.mark.parametrize("prompt", ["Respond briefly:", LONG])
def test_a_response_is_the_chat_answer_of_the_same_conversation(client, stack, prompt):
    """Greedy, the text, its tokens and the usage equal the chat path's; cut at max_output_tokens
    it is incomplete for that reason; instructions are the system message."""
    for max_tokens in (5, 40):
        response = respond(client, stack, [{"role": "user", "content": [{"type": "input_text", "text": prompt}]}],
                           instructions="Be brief.", max_output_tokens=max_tokens, temperature=0)
        choice = chat(client, stack, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}],
                      max_completion_tokens=max_tokens, temperature=0)
        assert response.id.startswith("resp_") and response.object == "response"
        assert response.output_text == choice.choices[0].message.content
        assert (response.usage.input_tokens, response.usage.output_tokens) == (
            choice.usage.prompt_tokens, choice.usage.completion_tokens)
        assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
        cut = choice.choices[0].finish_reason == "length"
        assert response.status == ("incomplete" if cut else "completed")
        assert (response.incomplete_details.reason if cut else response.incomplete_details) == (
            "max_output_tokens" if cut else None)
        assert (response.instructions, response.max_output_tokens, response.model) == (
            "Be brief.", max_tokens, stack.model_name)


def test_a_string_input_is_one_user_message(client, stack):
    response = respond(client, stack, "Plain string input", max_output_tokens=12, temperature=0)
    choice = chat(client, stack, [{"role": "user", "content": "Plain string input"}], max_tokens=12, temperature=0)
    assert response.output_text == choice.choices[0].message.content


@pytest.mark.parametrize("prompt", ["Stream it:", f"{LONG} stream"])
def test_a_stream_reassembles_to_the_whole_response(client, stack, prompt):
    whole = respond(client, stack, prompt, max_output_tokens=24, temperature=0)
    events = events_of(respond(client, stack, prompt, max_output_tokens=24, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    final = events[-1]
    assert final.type == f"response.{whole.status}"
    assert reassembled(events) == summary(whole) == summary(final.response)
    assert final.response.usage.output_tokens == whole.usage.output_tokens
    assert final.response.id == events[0].response.id


def test_logprobs_are_the_chat_paths(client, stack):
    response = respond(client, stack, "Score these tokens", max_output_tokens=6, temperature=0, top_logprobs=3,
                       include=["message.output_text.logprobs"])
    choice = chat(client, stack, [{"role": "user", "content": "Score these tokens"}], max_tokens=6, temperature=0,
                  logprobs=True, top_logprobs=3).choices[0]
    entries = response.output[0].content[0].logprobs
    assert [(e.token, round(e.logprob, 4), len(e.top_logprobs)) for e in entries] == [
        (c.token, round(c.logprob, 4), 3) for c in choice.logprobs.content]
    streamed = events_of(respond(client, stack, "Score these tokens", max_output_tokens=6, temperature=0,
                                 top_logprobs=3, include=["message.output_text.logprobs"], stream=True))
    deltas = [lp.token for e in streamed if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert deltas == [e.token for e in entries]
    assert [e.token for e in streamed[-1].response.output[0].content[0].logprobs] == deltas


def check_calls(response):
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls
    for call in calls:
        assert call.call_id.startswith("call_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_tool_calls_are_function_call_items_streamed_alike(client, stack, tool_choice):
    for prompt in ("Use a tool:", f"{LONG} tools"):
        whole = respond(client, stack, prompt, tools=TOOLS, tool_choice=tool_choice, temperature=0,
                        max_output_tokens=300)
        calls = check_calls(whole)
        if isinstance(tool_choice, dict):
            assert [c.name for c in calls] == ["get_weather"]
        assert whole.output_text == "" and whole.to_dict()["tool_choice"] == tool_choice
        events = events_of(respond(client, stack, prompt, tools=TOOLS, tool_choice=tool_choice, temperature=0,
                                   max_output_tokens=300, stream=True))
        strip = [{k: v for k, v in item.items() if k != "call_id"} for item in reassembled(events)]
        assert strip == [{k: v for k, v in item.items() if k != "call_id"} for item in summary(whole)]


def test_a_call_cut_short_is_incomplete_streamed_alike(client, stack):
    """A named call whose arguments max_output_tokens cuts: the response is incomplete and so is the
    call item, whole and streamed."""
    params = dict(tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                  max_output_tokens=3)
    whole = respond(client, stack, "Cut the call", **params)
    assert whole.status == "incomplete" and [(i.type, i.status) for i in whole.output] == [
        ("function_call", "incomplete")]
    events = events_of(respond(client, stack, "Cut the call", stream=True, **params))
    strip = [{k: v for k, v in item.items() if k != "call_id"} for item in reassembled(events)]
    assert strip == [{k: v for k, v in item.items() if k != "call_id"} for item in summary(whole)]


def test_auto_reads_calls_from_the_text_after_its_content(client, stack):
    """``auto`` parses Hermes-style calls from the text (a regex makes the random model write one):
    the content is a message item, the call a function_call item after it, streamed alike."""
    constraint = {"structured_outputs": {"regex": HERMES}, "seed": 4}
    whole = respond(client, stack, "Auto tools", tools=TOOLS, temperature=1.0, extra_body=constraint,
                    max_output_tokens=120)
    assert [item.type for item in whole.output] == ["message", "function_call"], whole.output
    assert whole.output_text == "Let me check."
    check_calls(whole)
    events = events_of(respond(client, stack, "Auto tools", tools=TOOLS, temperature=1.0,
                               extra_body=constraint, max_output_tokens=120, stream=True))
    items = reassembled(events)
    assert [{k: v for k, v in i.items() if k != "call_id"} for i in items] == [
        {k: v for k, v in i.items() if k != "call_id"} for i in summary(whole)]


def test_a_call_and_its_output_go_back_as_input_items(client, stack):
    """The next turn's input holds the call and its result: the answer equals the chat path's with
    the same history (an assistant message with the call, a tool message answering it)."""
    first = respond(client, stack, "Turn one:", tools=TOOLS, tool_choice="required", temperature=0,
                    max_output_tokens=300)
    call = check_calls(first)[0]
    follow = respond(client, stack, [{"role": "user", "content": "Turn one:"},
                                     {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                      "arguments": call.arguments},
                                     {"type": "function_call_output", "call_id": call.call_id, "output": '{"t": 21}'}],
                     tools=TOOLS, tool_choice="none", temperature=0, max_output_tokens=10)
    history = [{"role": "user", "content": "Turn one:"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.call_id, "type": "function", "function": {"name": call.name,
                                                                         "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": '{"t": 21}'}]
    tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
    expected = chat(client, stack, history, tools=tools, tool_choice="none", temperature=0, max_tokens=10)
    assert follow.output_text == expected.choices[0].message.content
    assert follow.usage.input_tokens == expected.usage.prompt_tokens


def test_text_format_json_schema_constrains_the_text(client, stack):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}}, "required": ["answer"],
              "additionalProperties": False}
    for seed in range(2):
        response = respond(client, stack, f"JSON please {seed}", temperature=1.0, max_output_tokens=200,
                           extra_body={"seed": seed},
                           text={"format": {"type": "json_schema", "name": "reply", "schema": schema, "strict": True}})
        assert response.status == "completed"
        jsonschema.validate(json.loads(response.output_text), schema)
        assert response.text.format.type == "json_schema"


@pytest.mark.parametrize("params, param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"background": True, "store": False}, "store"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "get_time", "arguments": "{}"}]}, "input[0].call_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"truncation": "auto"}, "truncation"),
    ({"temperature": 3}, "temperature"),
])
def test_what_is_not_offered_is_a_400_naming_the_field(client, stack, params, param):
    params.setdefault("input", "Refuse me")
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=stack.model_name, **params)
    assert info.value.body["param"] == param, info.value.body


def test_an_unknown_model_is_a_404(client, stack):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="hi")
