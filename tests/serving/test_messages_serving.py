"""Anthropic's Messages API served (``/v1/messages``): a real gateway, prefill and decode workers,
Redis and the official anthropic client.  A message is the chat path's answer in another shape: its
text and token counts equal a chat completion's of the same conversation (greedy); a stream's events
come in the documented order and the client's stream helper rebuilds the whole message from them;
tool calls are ``tool_use`` blocks valid by their schemas (streamed, the same) and go back as
``tool_use`` / ``tool_result`` blocks on the next turn; ``output_config.format`` constrains the text;
``count_tokens`` counts what a message computes; errors come in that API's shape, and the API key may
come as ``x-api-key``."""
from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from tests.support.checkpoints import TRAINING_TEXT
from tests.support.cluster import extra_gateway

pytestmark = pytest.mark.slow(seconds=14)  # a long file: scheduled by its length (tests/conftest.py)

API_KEY = "sk-messages-test-0123456789"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
         {"name": "get_time", "input_schema": TIME}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
LONG = "Messages: " + " ".join(TRAINING_TEXT) * 2  # over --skip-prefill-below: the prefill worker samples first
HERMES = ('Let me check\\. <tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "[a-z]{1,5}", '
          '"unit": "c"\\}\\}\\n</tool_call>')


@pytest.fixture(scope="module")
def messages(stack):
    return anthropic.Anthropic(base_url=stack.gateway_url, api_key="unused", max_retries=0, timeout=120)


def chat(client, stack, messages, **params):
    return client.chat.completions.create(model=stack.model_name, messages=messages, **params)


def sampling(params: dict) -> dict:
    """``params`` with its temperature in ``extra_body`` (this SDK's ``create`` no longer takes one;
    older ones, and the API, do)."""
    if "temperature" in params:
        params["extra_body"] = {**params.get("extra_body", {}), "temperature": params.pop("temperature")}
    return params


def create(messages, stack, content, **params):
    turns = content if isinstance(content, list) else [{"role": "user", "content": content}]
    return messages.messages.create(model=stack.model_name, messages=turns, max_tokens=params.pop("max_tokens", 40),
                                    **sampling(params))


@pytest.mark.parametrize("prompt", ["Answer briefly:", LONG])
def test_a_message_is_the_chat_answer_of_the_same_conversation(messages, client, stack, prompt):
    for max_tokens in (5, 40):
        message = create(messages, stack, [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
                         system=[{"type": "text", "text": "Be brief."}], max_tokens=max_tokens, temperature=0)
        choice = chat(client, stack, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}],
                      max_tokens=max_tokens, temperature=0)
        assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
        assert [b.type for b in message.content] == ["text"]
        assert message.content[0].text == choice.choices[0].message.content
        usage = message.usage
        assert usage.input_tokens + usage.cache_read_input_tokens == choice.usage.prompt_tokens
        assert usage.output_tokens == choice.usage.completion_tokens
        cut = choice.choices[0].finish_reason == "length"
        assert message.stop_reason == ("max_tokens" if cut else "end_turn")


def test_a_stop_sequence_is_named(messages, stack):
    whole = create(messages, stack, "Stop somewhere", temperature=0, max_tokens=30).content[0].text
    sequence = whole[3:6]
    message = create(messages, stack, "Stop somewhere", temperature=0, max_tokens=30, stop_sequences=[sequence])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", sequence)
    assert message.content[0].text == whole[:whole.index(sequence)]


@pytest.mark.parametrize("prompt", ["Stream it:", f"{LONG} stream"])
def test_a_stream_rebuilds_the_whole_message(messages, stack, prompt):
    whole = create(messages, stack, prompt, max_tokens=24, temperature=0)
    with messages.messages.stream(model=stack.model_name, messages=[{"role": "user", "content": prompt}],
                                  max_tokens=24, **sampling({"temperature": 0})) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)


def check_calls(message):
    calls = [b for b in message.content if b.type == "tool_use"]
    assert calls and message.stop_reason == "tool_use"
    for call in calls:
        assert call.id.startswith("toolu_")
        jsonschema.validate(call.input, SCHEMAS[call.name])
    return calls


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_tool_calls_are_tool_use_blocks_streamed_alike(messages, stack, tool_choice):
    for prompt in ("Use a tool:", f"{LONG} tools"):
        whole = create(messages, stack, prompt, tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=300)
        calls = check_calls(whole)
        if tool_choice["type"] == "tool":
            assert [c.name for c in calls] == ["get_weather"]
        with messages.messages.stream(model=stack.model_name, messages=[{"role": "user", "content": prompt}],
                                      tools=TOOLS, tool_choice=tool_choice, max_tokens=300,
                                      **sampling({"temperature": 0})) as stream:
            final = stream.get_final_message()
        assert [(b.name, b.input) for b in check_calls(final)] == [(c.name, c.input) for c in calls]


def test_auto_reads_calls_from_the_text_after_its_content(messages, stack):
    constraint = {"structured_outputs": {"regex": HERMES}, "seed": 4, "temperature": 1.0}
    whole = create(messages, stack, "Auto tools", tools=TOOLS, extra_body=constraint, max_tokens=120)
    assert [b.type for b in whole.content] == ["text", "tool_use"] and whole.content[0].text == "Let me check."
    check_calls(whole)
    with messages.messages.stream(model=stack.model_name, messages=[{"role": "user", "content": "Auto tools"}],
                                  tools=TOOLS, extra_body=constraint, max_tokens=120) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "text", None), getattr(b, "input", None)) for b in final.content] == [
        (b.type, getattr(b, "text", None), getattr(b, "input", None)) for b in whole.content]


def test_a_tool_result_goes_back_on_the_next_turn(messages, client, stack):
    first = create(messages, stack, "Turn one:", tools=TOOLS, tool_choice={"type": "any"}, temperature=0,
                   max_tokens=300)
    call = check_calls(first)[0]
    turns = [{"role": "user", "content": "Turn one:"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name,
                                                "input": call.input}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                           "content": [{"type": "text", "text": '{"t": 21}'}]},
                                          {"type": "text", "text": "And now?"}]}]
    follow = create(messages, stack, turns, tools=TOOLS, tool_choice={"type": "none"}, temperature=0, max_tokens=10)
    history = [{"role": "user", "content": "Turn one:"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.id, "type": "function", "function": {"name": call.name,
                                                                    "arguments": json.dumps(call.input)}}]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"t": 21}'},
               {"role": "user", "content": "And now?"}]
    tools = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"],
                                                **({"description": t["description"]} if "description" in t else {})}}
             for t in TOOLS]
    expected = chat(client, stack, history, tools=tools, tool_choice="none", temperature=0, max_tokens=10)
    assert follow.content[0].text == expected.choices[0].message.content
    assert follow.usage.input_tokens + follow.usage.cache_read_input_tokens == expected.usage.prompt_tokens
    counted = messages.messages.count_tokens(model=stack.model_name, messages=turns, tools=TOOLS,
                                             tool_choice={"type": "none"})
    assert counted.input_tokens == expected.usage.prompt_tokens


def test_a_last_assistant_turn_is_continued(messages, client, stack):
    """Anthropic's prefill: the answer goes on from the assistant's text rather than starting a turn.
    Greedy, it equals a completion of the template's rendering left open after that text."""
    from transformers import AutoTokenizer

    turns = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    message = create(messages, stack, turns, temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
    tokenizer = AutoTokenizer.from_pretrained(stack.checkpoint)
    ids = tokenizer(tokenizer.apply_chat_template(turns, continue_final_message=True, tokenize=False),
                    add_special_tokens=False).input_ids
    expected = client.completions.create(model=stack.model_name, prompt=ids, temperature=0, max_tokens=12)
    assert message.content[0].text == expected.choices[0].text
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(ids)
    counted = messages.messages.count_tokens(model=stack.model_name, messages=turns)
    assert counted.input_tokens == len(ids)


def test_output_config_format_constrains_the_text(messages, stack):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}}, "required": ["answer"],
              "additionalProperties": False}
    for seed in range(2):
        message = create(messages, stack, f"JSON please {seed}", temperature=1.0, max_tokens=200,
                         extra_body={"seed": seed, "output_config": {"format": {"type": "json_schema",
                                                                                "schema": schema}}})
        assert message.stop_reason == "end_turn"
        jsonschema.validate(json.loads(message.content[0].text), schema)


@pytest.mark.parametrize("params, text", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://x"}}]}]},
     "messages[0].content[0]"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    ({"extra_body": {"thinking": {"type": "enabled", "budget_tokens": 1024}}}, "thinking"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"extra_body": {"temperature": 1.5}}, "temperature"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
])
def test_refusals_are_400s_in_the_apis_error_shape(messages, stack, params, text):
    params.setdefault("messages", [{"role": "user", "content": "Refuse me"}])
    with pytest.raises(anthropic.BadRequestError) as info:
        messages.messages.create(model=stack.model_name, max_tokens=8, **params)
    body = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert text in body["error"]["message"], body


def test_an_unknown_model_is_a_404(messages):
    with pytest.raises(anthropic.NotFoundError) as info:
        messages.messages.create(model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["error"]["type"] == "not_found_error"


def test_the_api_key_may_come_as_x_api_key(stack):
    with extra_gateway(stack, "messages-keys", ["--api-key", API_KEY]) as gateway:
        good = anthropic.Anthropic(base_url=gateway.url, api_key=API_KEY, max_retries=0, timeout=120)
        message = good.messages.create(model=stack.model_name, max_tokens=4, extra_body={"ignore_eos": True},
                                       messages=[{"role": "user", "content": "Keyed"}])
        assert message.usage.output_tokens == 4
        bad = anthropic.Anthropic(base_url=gateway.url, api_key="sk-wrong", max_retries=0, timeout=120)
        with pytest.raises(anthropic.AuthenticationError) as info:
            bad.messages.create(model=stack.model_name, max_tokens=4, messages=[{"role": "user", "content": "x"}])
        assert info.value.body["error"]["type"] == "authentication_error"
