"""Background responses served (gateway/background_responses.py): a real gateway, prefill and decode
workers, Redis and the official openai client.  ``background: true`` is answered ``queued`` at once;
polled, it becomes the answer the same request gets in the foreground (greedy: text and usage), is
continued and listed as a stored response is, and cancelling it once it ended returns it as it
ended.  Streamed, its events are the foreground stream's, and they are streamed again from the first
or after any one (not a response that was not streamed so).  It is stored: ``store: false`` is a 400.
(A run cancelled, holding its key's slot, failing or given up by a stopping gateway:
tests/gateway/test_gateway_inprocess.py, where a run waits for a worker as long as a test needs.)"""
from __future__ import annotations

import time

import openai
import pytest

DEADLINE_S = 120


def respond(client, stack, input, **params):
    return client.responses.create(model=stack.model_name, input=input, temperature=0, **params)


def polled(client, response_id: str):
    """The response once it has ended (polled as OpenAI's guide polls)."""
    deadline = time.monotonic() + DEADLINE_S
    while (response := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"still {response.status}"
        time.sleep(0.05)
    return response


def test_a_background_response_polled_is_the_foreground_answer(client, stack):
    queued = respond(client, stack, "Run this in the background", max_output_tokens=12, background=True)
    assert (queued.status, queued.background, queued.store, queued.output, queued.usage) == (
        "queued", True, True, [], None)
    done = polled(client, queued.id)
    foreground = respond(client, stack, "Run this in the background", max_output_tokens=12)
    assert done.status == foreground.status and done.status in ("completed", "incomplete")
    assert (done.output_text, done.usage.input_tokens, done.usage.output_tokens) == (
        foreground.output_text, foreground.usage.input_tokens, foreground.usage.output_tokens)
    assert (done.id, done.background) == (queued.id, True)
    # continued and listed as any stored response
    after = respond(client, stack, "And then", previous_response_id=done.id, max_output_tokens=6)
    same = respond(client, stack, "And then", previous_response_id=foreground.id, max_output_tokens=6)
    assert (after.output_text, after.usage.input_tokens) == (same.output_text, same.usage.input_tokens)
    assert [i.content[0].text for i in client.responses.input_items.list(done.id).data] == [
        "Run this in the background"]
    assert client.responses.cancel(done.id).model_dump() == done.model_dump()  # it ended: as it ended


def test_a_background_response_continues_a_stored_one(client, stack):
    first = respond(client, stack, "First turn", max_output_tokens=6)
    queued = respond(client, stack, "Second turn", previous_response_id=first.id, max_output_tokens=8,
                     background=True)
    done = polled(client, queued.id)
    foreground = respond(client, stack, "Second turn", previous_response_id=first.id, max_output_tokens=8)
    assert (done.output_text, done.usage.input_tokens, done.previous_response_id) == (
        foreground.output_text, foreground.usage.input_tokens, first.id)


def test_a_streamed_background_response_is_the_foreground_stream_and_resumes_after_any_event(client, stack):
    events = list(respond(client, stack, "Stream this in the background", max_output_tokens=12, background=True,
                          stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response
    foreground = list(respond(client, stack, "Stream this in the background", max_output_tokens=12, stream=True))
    assert [e.type for e in events] == ["response.created", "response.queued", *(e.type for e in foreground[1:])]
    assert (events[0].response.status, events[2].response.status) == ("queued", "in_progress")
    assert [getattr(e, "delta", None) for e in events[1:]] == [getattr(e, "delta", None) for e in foreground]
    assert (final.background, final.store) == (True, True)
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()  # stored before its last event
    resumed = list(client.responses.retrieve(final.id, stream=True, starting_after=2))
    assert [e.model_dump() for e in resumed] == [e.model_dump() for e in events[3:]]
    assert [e.model_dump() for e in client.responses.retrieve(final.id, stream=True)] == [
        e.model_dump() for e in events]


def test_only_a_streamed_background_response_is_streamed_again(client, stack):
    polled_only = respond(client, stack, "Not streamed", max_output_tokens=4, background=True)
    polled(client, polled_only.id)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.retrieve(polled_only.id, stream=True)
    assert info.value.body["param"] == "stream"


def test_a_background_response_is_stored(client, stack):
    with pytest.raises(openai.BadRequestError) as info:
        respond(client, stack, "Refused", max_output_tokens=4, background=True, store=False)
    assert (info.value.body["param"], info.value.body["code"]) == ("store", "unsupported_value")
