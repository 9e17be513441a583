"""Stored responses served (gateway/response_store.py, gateway/stored_responses.py): a real gateway,
prefill and decode workers, Redis and the official openai client.  A response is retrieved as it was
answered, whole or streamed; one continued by ``previous_response_id`` is the chat answer of the whole
conversation (greedy) -- the chain's turns, not their instructions -- and a function call's output
continues the response that made it; its input items are its own input, paged; its input tokens are
counted as it has them; ``store: false`` keeps nothing; a deleted response is gone; an API key reads
and deletes only its own; a gateway that stores nothing says so, naming the field."""
from __future__ import annotations

import openai
import pytest

from tests.support.cluster import extra_gateway

pytestmark = pytest.mark.slow(seconds=38)  # a long file: scheduled by its length (tests/conftest.py)

KEYS = {"a": "sk-stored-a-0123456789", "b": "sk-stored-b-0123456789"}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
# The small stack's template with the assistant's calls written out (its own leaves them out)
CALLS_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}"
                  "{% for c in m.get('tool_calls') or [] %}[{{ c['function']['name'] }} {{ c['function']['arguments'] }}]"
                  "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def respond(client, stack, input, **params):
    return client.responses.create(model=stack.model_name, input=input, temperature=0, **params)


def chat(client, stack, messages, **params):
    return client.chat.completions.create(model=stack.model_name, messages=messages, temperature=0, **params)


def test_a_response_is_retrieved_as_it_was_answered_whole_or_streamed(client, stack):
    whole = respond(client, stack, "Keep this answer", max_output_tokens=8)
    assert whole.store is True
    assert client.responses.retrieve(whole.id).model_dump() == whole.model_dump()
    final = list(respond(client, stack, "Keep this stream", max_output_tokens=8, stream=True))[-1].response
    assert final.store is True
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()


def test_a_continued_response_is_the_chat_answer_of_the_whole_conversation(client, stack):
    first = respond(client, stack, "Tell me one thing", instructions="Be brief.", max_output_tokens=10)
    second = respond(client, stack, "And another", previous_response_id=first.id, max_output_tokens=10)
    turns = [{"role": "user", "content": "Tell me one thing"}, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "And another"}]
    expected = chat(client, stack, turns, max_completion_tokens=10)  # the first's instructions are not carried
    assert second.output_text == expected.choices[0].message.content
    assert second.usage.input_tokens == expected.usage.prompt_tokens
    assert (second.previous_response_id, second.instructions) == (first.id, None)
    # a streamed turn continues the chain, and is continued in its turn
    events = list(respond(client, stack, "Third", previous_response_id=second.id, max_output_tokens=10, stream=True))
    third = events[-1].response
    turns += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Third"}]
    assert third.output_text == chat(client, stack, turns, max_completion_tokens=10).choices[0].message.content
    fourth = respond(client, stack, "Last", previous_response_id=third.id, instructions="Be kind.", max_output_tokens=10)
    turns = [{"role": "system", "content": "Be kind."}, *turns, {"role": "assistant", "content": third.output_text},
             {"role": "user", "content": "Last"}]
    assert fourth.output_text == chat(client, stack, turns, max_completion_tokens=10).choices[0].message.content


def test_a_responses_input_tokens_are_counted_as_it_would_have_them(client, stack):
    first = respond(client, stack, "Count me", instructions="Be brief.", max_output_tokens=6)
    count = client.responses.input_tokens.count(model=stack.model_name, input="Count me", instructions="Be brief.")
    assert (count.object, count.input_tokens) == ("response.input_tokens", first.usage.input_tokens)
    second = respond(client, stack, "And on", previous_response_id=first.id, max_output_tokens=6)
    assert client.responses.input_tokens.count(input="And on", previous_response_id=first.id).input_tokens == (
        second.usage.input_tokens)  # the model left out: the served one
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.input_tokens.count(input="x", previous_response_id="resp_" + "0" * 32)
    assert info.value.body["param"] == "previous_response_id"


def test_a_responses_input_items_are_its_own_input_paged(client, stack):
    first = respond(client, stack, "Opening line", max_output_tokens=4)
    sent = [{"role": "user", "content": "One"}, {"role": "assistant", "content": "Two"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
            {"role": "user", "content": [{"type": "input_text", "text": "Three"}]}]
    second = respond(client, stack, sent, previous_response_id=first.id, max_output_tokens=4)
    listed = client.responses.input_items.list(second.id, order="asc")
    assert [(i.type, getattr(i, "role", None)) for i in listed.data] == [
        ("message", "user"), ("message", "assistant"), ("function_call", None), ("function_call_output", None),
        ("message", "user")]  # this response's input alone, not the one it continued
    assert [i.content[0].text for i in listed.data if i.type == "message"] == ["One", "Two", "Three"]
    call, result = listed.data[2], listed.data[3]
    assert (call.call_id, call.name, call.arguments, result.call_id, result.output) == (
        "call_1", "get_weather", '{"city": "Oslo"}', "call_1", "Sunny")
    newest = client.responses.input_items.list(second.id, limit=2)  # desc by default
    assert [i.id for i in newest.data] == [i.id for i in listed.data[::-1][:2]] and newest.has_more
    rest = client.responses.input_items.list(second.id, limit=10, after=newest.data[-1].id)
    assert [i.id for i in rest.data] == [i.id for i in listed.data[::-1][2:]] and not rest.has_more
    assert [i.content[0].text for i in client.responses.input_items.list(first.id).data] == ["Opening line"]


def test_a_function_calls_output_continues_the_response_that_made_it(stack, keyed):
    """On a gateway whose template writes the calls out: the stored conversation holds the call."""
    client = keyed["a"]
    first = respond(client, stack, "Weather in Oslo?", tools=TOOLS,
                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    call = next(item for item in first.output if item.type == "function_call")
    second = respond(client, stack, [{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}],
                     previous_response_id=first.id, tools=TOOLS, max_output_tokens=10)
    turns = [{"role": "user", "content": "Weather in Oslo?"},
             {"role": "assistant", "content": first.output_text or None, "tool_calls": [
                 {"id": call.call_id, "type": "function",
                  "function": {"name": call.name, "arguments": call.arguments}}]},
             {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    expected = chat(client, stack, turns, tools=tools, max_completion_tokens=10)
    assert second.output_text == (expected.choices[0].message.content or "")
    assert second.usage.input_tokens == expected.usage.prompt_tokens
    without_call = chat(client, stack, [turns[0], {"role": "assistant", "content": first.output_text}, turns[2]],
                        tools=tools, max_completion_tokens=1)
    assert without_call.usage.prompt_tokens < expected.usage.prompt_tokens  # the template tells them apart


def test_what_is_not_stored_or_deleted_cannot_be_read_or_continued(client, stack):
    unkept = respond(client, stack, "Do not keep this", max_output_tokens=4, store=False)
    assert unkept.store is False
    kept = respond(client, stack, "Keep this one", max_output_tokens=4)
    client.responses.delete(kept.id)
    for gone in (unkept.id, kept.id):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone)
        with pytest.raises(openai.BadRequestError) as info:
            respond(client, stack, "More", previous_response_id=gone, max_output_tokens=4)
        assert (info.value.body["param"], info.value.body["code"]) == ("previous_response_id",
                                                                        "previous_response_not_found")
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(kept.id)
    kept = respond(client, stack, "Keep this too", max_output_tokens=4)
    with pytest.raises(openai.BadRequestError) as info:  # (only a streamed background response is streamed again)
        client.responses.retrieve(kept.id, stream=True)
    assert info.value.body["param"] == "stream"


@pytest.fixture(scope="module")
def keyed(stack, tmp_path_factory):
    """A second gateway on the same pools with two API keys and a template that writes calls out."""
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text("".join(f"{k}\n" for k in KEYS.values()))
    with extra_gateway(stack, "stored", ["--api-keys-file", str(keys), "--chat-template", CALLS_TEMPLATE]) as proc:
        yield {name: openai.OpenAI(base_url=f"{proc.url}/v1", api_key=key, max_retries=0, timeout=120)
               for name, key in KEYS.items()}


def test_an_api_key_reads_and_deletes_only_its_own(stack, keyed):
    mine = respond(keyed["a"], stack, "Mine alone", max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        keyed["b"].responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        keyed["b"].responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        keyed["b"].responses.input_items.list(mine.id)
    with pytest.raises(openai.BadRequestError):
        respond(keyed["b"], stack, "Theirs", previous_response_id=mine.id, max_output_tokens=4)
    assert keyed["a"].responses.retrieve(mine.id).output_text == mine.output_text


@pytest.fixture(scope="module")
def storeless(stack):
    with extra_gateway(stack, "storeless", [], env={"PDSERVE_RESPONSES_STORE_TTL": "0"}) as proc:
        yield openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_gateway_that_stores_nothing_says_so_naming_the_field(stack, storeless):
    answered = respond(storeless, stack, "Not kept", max_output_tokens=4)
    assert answered.store is False
    for params, param in (({"store": True}, "store"), ({"previous_response_id": answered.id}, "previous_response_id")):
        with pytest.raises(openai.BadRequestError) as info:
            respond(storeless, stack, "Refused", max_output_tokens=4, **params)
        assert info.value.body["param"] == param
    with pytest.raises(openai.BadRequestError):
        storeless.responses.retrieve(answered.id)
