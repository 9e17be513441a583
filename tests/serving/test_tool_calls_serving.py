"""Tool calls served: a real gateway, prefill and decode workers, Redis and the official openai
client.  ``required`` and a named function are enforced by a grammar built from the tools'
schemas (valid calls every time, sampled, short prompts and long ones through the prefill pool);
``auto`` is parsed from the text (Hermes-style ``<tool_call>`` blocks); streamed deltas reassemble
to the non-streamed calls; a tool result goes back on the next turn."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.support.checkpoints import TRAINING_TEXT

pytestmark = pytest.mark.slow(seconds=18)  # a long file: scheduled by its length (tests/conftest.py)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
SHORT = "Use a tool:"
LONG = "Tools: " + " ".join(TRAINING_TEXT) * 2  # over --skip-prefill-below: the prefill worker samples the first token


def ask(client, stack, content, **params):
    messages = params.pop("messages", [{"role": "user", "content": content}])
    return client.chat.completions.create(model=stack.model_name, messages=messages, tools=TOOLS,
                                          max_tokens=params.pop("max_tokens", 120), **params)


def check_calls(calls):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_makes_valid_calls_every_time(client, stack):
    for seed in range(4):
        for prompt in (f"{SHORT} {seed}", f"{LONG} {seed}"):
            # (a random model may go on adding calls to the array for a while)
            choice = ask(client, stack, prompt, tool_choice="required", temperature=1.0, seed=seed,
                         max_tokens=600).choices[0]
            assert choice.finish_reason == "tool_calls", choice
            assert choice.message.content is None
            check_calls(choice.message.tool_calls)


def test_required_without_parallel_calls_makes_one(client, stack):
    for seed in range(3):
        choice = ask(client, stack, f"{LONG} one {seed}", tool_choice="required", parallel_tool_calls=False,
                     temperature=1.0, seed=seed).choices[0]
        assert len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls)


def test_named_function(client, stack):
    for seed, prompt in enumerate((SHORT, LONG)):
        choice = ask(client, stack, f"{prompt} named", temperature=1.0, seed=seed,
                     tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0]
        assert choice.finish_reason == "stop"  # a named function's call (OpenAI's API, vLLM)
        assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
        check_calls(choice.message.tool_calls)


def reassemble(stream, opening_content=""):
    """The calls, content and finish of a stream; its first delta's content is ``opening_content``
    (None where the answer can only be calls: it was "", as no whole answer's content is)."""
    calls, content, finish, first = {}, "", None, True
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if first:
            assert (choice.delta.role, choice.delta.content) == ("assistant", opening_content), choice.delta
            first = False
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.function.name, "a call's first delta carries its id and name"
                calls[d.index] = {"name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], content or None, finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_deltas_reassemble_to_the_non_streamed_calls(client, stack, tool_choice):
    for prompt in (f"{SHORT} stream", f"{LONG} stream"):
        whole = ask(client, stack, prompt, tool_choice=tool_choice, temperature=0, max_tokens=600).choices[0]
        assert whole.finish_reason == ("tool_calls" if tool_choice == "required" else "stop"), whole
        calls, content, finish = reassemble(ask(client, stack, prompt, tool_choice=tool_choice, temperature=0, max_tokens=600,
                                                stream=True), opening_content=None)
        assert calls == [{"name": c.function.name, "arguments": c.function.arguments}
                         for c in whole.message.tool_calls]
        assert content is None and finish == whole.finish_reason


HERMES = ('<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "[a-z]{1,5}", "unit": "c"\\}\\}\\n'
          '</tool_call>')


def test_auto_parses_hermes_calls_from_the_text(client, stack):
    """``auto`` reads calls from free text; here a regex makes the random model write one."""
    for prompt in (SHORT, LONG):
        constraint = {"structured_outputs": {"regex": "Let me check\\. " + HERMES}}
        whole = ask(client, stack, f"{prompt} auto", temperature=1.0, seed=4, extra_body=constraint).choices[0]
        assert whole.finish_reason == "tool_calls"
        assert whole.message.content == "Let me check."
        check_calls(whole.message.tool_calls)
        calls, content, finish = reassemble(ask(client, stack, f"{prompt} auto", temperature=1.0, seed=4,
                                                extra_body=constraint, stream=True))
        assert calls == [{"name": c.function.name, "arguments": c.function.arguments}
                         for c in whole.message.tool_calls]
        assert (content, finish) == ("Let me check.", "tool_calls")


def test_auto_without_a_call_is_plain_content(client, stack):
    choice = ask(client, stack, f"{SHORT} plain", temperature=0, max_tokens=30,
                 extra_body={"structured_outputs": {"regex": "No tool needed"}}).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == ("No tool needed", None, "stop")
    none = ask(client, stack, f"{SHORT} none", tool_choice="none", temperature=0, max_tokens=60,
               extra_body={"structured_outputs": {"regex": HERMES}}).choices[0]
    assert none.message.tool_calls is None and none.message.content.startswith("<tool_call>")


def test_a_tool_result_on_the_next_turn(client, stack):
    first = ask(client, stack, f"{SHORT} turn", tool_choice="required", temperature=0).choices[0].message
    history = [{"role": "user", "content": f"{SHORT} turn"}, first,  # the answer sent back as the client parsed it
               *[{"role": "tool", "tool_call_id": c.id, "content": '{"temp": 21}'} for c in first.tool_calls]]
    answer = ask(client, stack, None, messages=history, temperature=0, max_tokens=6).choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls is None


@pytest.mark.parametrize("params, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/x"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tools_are_400s_naming_the_field(client, stack, params, param):
    tools = params.pop("tools", TOOLS)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=stack.model_name, messages=[{"role": "user", "content": SHORT}],
                                       tools=tools, **params)
    assert info.value.body["param"] == param, info.value.body
