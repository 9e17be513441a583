"""The Responses and Messages APIs' answers, built from a finished generation, validated against the
official SDKs' own models (every field they require, of the right type), whole and streamed; and
their ends: cut short, aborted, failed mid-way."""
from __future__ import annotations

import json

import anthropic.types
import msgspec
import openai.types.responses
import pydantic
import pytest

from common.cluster.messages import TokenFrame
from gateway.generation import Generation
from gateway.messages_output import MessagesAnswer
from gateway.messages_request import parse_messages_request
from gateway.openai_errors import OpenAIError
from gateway.response_shapes import ResponseShapes
from gateway.responses_output import ResponsesAnswer
from gateway.responses_request import parse_responses_request

RESPONSE_EVENT = pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent)
MESSAGE_EVENT = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)


def generation(chat, pieces: list[str], finish: str | None, cached: int = 2) -> Generation:
    gen = Generation("r", "chat", "m", [5, 6, 7, 8], chat.sampling(), None)
    gen.pieces, gen.token_ids, gen.finish_reason = list(pieces), list(range(len(pieces))), finish
    gen.cached_tokens = cached
    return gen


def events(data: bytes) -> list[dict]:
    """The JSON of each SSE event, its ``event:`` line naming the same type."""
    out = []
    for block in data.decode().split("\n\n"):
        if block:
            kind, payload = block.split("\n")
            event = json.loads(payload.removeprefix("data: "))
            assert kind == f"event: {event['type']}"
            out.append(event)
    return out


def responses(**body):
    call = parse_responses_request(json.dumps({"model": "m", "input": "hi", **body}).encode())
    return call, ResponsesAnswer(call, ResponseShapes(tokenizer=None))


@pytest.mark.parametrize("finish, status", [("stop", "completed"), ("length", "incomplete"), ("abort", "failed")])
def test_a_response_is_valid_by_the_sdks_model_whole_and_streamed(finish, status):
    call, answer = responses(max_output_tokens=2)
    whole = answer.whole([generation(call.chat, ["Hel", "lo"], finish)])
    model = openai.types.responses.Response.model_validate(msgspec.to_builtins(whole))
    assert (model.status, model.output_text, model.usage.input_tokens_details.cached_tokens) == (status, "Hello", 2)
    gen = generation(call.chat, [], None)
    stream = answer.stream(gen)
    data = stream.opening()
    for piece in ("Hel", "lo"):
        gen.pieces.append(piece)
        gen.token_ids.append(0)
        gen.finish_reason = finish if piece == "lo" else None
        data += stream.batch(gen, [(piece, TokenFrame())])
    data += stream.closing()
    sent = [RESPONSE_EVENT.validate_python(e) for e in events(data)]
    assert [e.sequence_number for e in sent] == list(range(len(sent)))
    assert sent[-1].type == f"response.{status}" and sent[-1].response.output_text == "Hello"


@pytest.mark.parametrize("status, code", [(429, "rate_limit_exceeded"), (400, "invalid_prompt"), (502, "server_error")])
def test_a_response_failed_mid_way_names_the_kind_of_failure(status, code):
    """A client's error (a grammar the output broke mid-way) is not the server's."""
    call, answer = responses()
    gen = generation(call.chat, ["Hi"], None)
    stream = answer.stream(gen)
    data = stream.opening() + stream.batch(gen, [("Hi", TokenFrame())]) + stream.failure(OpenAIError(status, "why"))
    failed = RESPONSE_EVENT.validate_python(events(data)[-1])
    assert (failed.type, failed.response.error.code, failed.response.output[0].status) == (
        "response.failed", code, "incomplete")


def messages_request(**body):
    return parse_messages_request(json.dumps({"model": "m", "max_tokens": 4,
                                              "messages": [{"role": "user", "content": "hi"}], **body}).encode())


@pytest.mark.parametrize("stored", [True, False])
async def test_a_response_says_whether_it_was_stored_whole_and_streamed(stored):
    """``store`` is true where the keeper stored it, false where it could not (and a stream that
    failed is not stored); the keeper gets the response and its output as the next message."""
    kept = []

    async def keeper(response, output, closing=()):
        kept.append((response.id, [(m.role, m.content) for m in output]))
        return stored

    call = parse_responses_request(json.dumps({"model": "m", "input": "hi"}).encode())
    answer = ResponsesAnswer(call, ResponseShapes(tokenizer=None), keeper)
    whole = answer.whole([generation(call.chat, ["Hel", "lo"], "stop")])
    assert whole.store is True  # until kept
    await answer.keep(whole)
    assert whole.store is stored and kept == [(answer.response_id, [("assistant", "Hello")])]
    gen = generation(call.chat, ["Hi"], "stop")
    stream = answer.stream(gen)
    opening = events(stream.opening())
    await stream.keep()
    final = events(stream.closing())[-1]
    assert (opening[0]["response"]["store"], final["type"], final["response"]["store"]) == (True, "response.completed",
                                                                                           stored)
    failed = answer.stream(generation(call.chat, ["Hi"], None))
    failed.opening()
    assert events(failed.failure(OpenAIError(500, "lost")))[-1]["response"]["store"] is False


@pytest.mark.parametrize("finish, reason", [("stop", "end_turn"), ("length", "max_tokens")])
def test_a_message_is_valid_by_the_sdks_model_whole_and_streamed(finish, reason):
    chat = messages_request()
    answer = MessagesAnswer()
    whole = anthropic.types.Message.model_validate(msgspec.to_builtins(answer.whole([generation(chat, ["Hel", "lo"], finish)])))
    assert (whole.stop_reason, whole.content[0].text) == (reason, "Hello")
    assert (whole.usage.input_tokens, whole.usage.cache_read_input_tokens, whole.usage.output_tokens) == (2, 2, 2)
    gen = generation(chat, ["Hel", "lo"], finish)
    stream = answer.stream(gen)
    data = stream.opening() + stream.batch(gen, [("Hel", TokenFrame()), ("lo", TokenFrame())]) + stream.closing()
    sent = [MESSAGE_EVENT.validate_python(e) for e in events(data)]
    assert [e.type for e in sent] == ["message_start", "content_block_start", "content_block_delta",
                                      "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert sent[-2].delta.stop_reason == reason and sent[-2].usage.output_tokens == 2


def test_an_aborted_message_is_an_error_whole_and_streamed():
    chat = messages_request()
    answer = MessagesAnswer()
    with pytest.raises(OpenAIError) as info:
        answer.whole([generation(chat, ["Hi"], "abort")])
    assert info.value.status == 500
    gen = generation(chat, ["Hi"], "abort")
    stream = answer.stream(gen)
    sent = events(stream.opening() + stream.batch(gen, [("Hi", TokenFrame())]) + stream.closing())
    assert [e["type"] for e in sent[-2:]] == ["content_block_stop", "error"]
    assert sent[-1]["error"]["type"] == "api_error"

