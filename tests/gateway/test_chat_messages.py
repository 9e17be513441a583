"""Chat messages (gateway/chat_messages.py) as chat requests read them: roles, content parts, tool
calls and their results, and an answer sent back as the official client returned it -- from
``create()``, ``parse()`` and ``stream()`` -- is the next turn's history."""
from __future__ import annotations

import msgspec
import openai
from aiohttp import web
from aiohttp.test_utils import TestServer
from openai.types.chat import ChatCompletion

from gateway.openai_protocol import (
    SSE_DONE, SSE_HEADERS, ChatChoice, ChatCompletionChunk, ChatCompletionResponse, ChatDelta,
    ChatResponseMessage, ChatStreamChoice, OpenAIError, json_response, parse_chat_request, sse_event,
)
from gateway.openai_responses import DeltaFunction, DeltaToolCall, ResponseFunction, ResponseToolCall
from tests.support.request_bodies import body, chat, rejects


def test_chat_messages_and_max_tokens_alias():
    req = parse_chat_request(body(model="m", messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}],
         "name": "ann"},
        {"role": "assistant", "content": "Hi."},
    ], max_tokens=20, logprobs=True, top_logprobs=3))
    assert req.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, \nworld", "name": "ann"},  # parts a line apart, as vLLM's
        {"role": "assistant", "content": "Hi."},
    ]
    s = req.sampling()
    assert (s.max_tokens, s.logprobs) == (20, 3)
    assert parse_chat_request(chat(max_completion_tokens=9)).sampling().max_tokens == 9
    assert parse_chat_request(chat()).sampling().max_tokens is None
    assert parse_chat_request(chat(logprobs=True)).sampling().logprobs == 0
    assert parse_chat_request(chat()).sampling().logprobs is None


def test_chat_rejections():
    assert parse_chat_request(chat(max_tokens=5, max_completion_tokens=6)).sampling().max_tokens == 6  # (vLLM's)
    rejects(parse_chat_request, chat(top_logprobs=2), "top_logprobs", "requires logprobs")
    rejects(parse_chat_request, body(model="m", messages=[]), "messages", "at least length 1")
    rejects(parse_chat_request, body(model="m", messages=[{"role": "tool", "content": "x"}]),
            "messages[0].tool_call_id", "a tool message needs tool_call_id")
    rejects(parse_chat_request, body(model="m", messages=[{"role": "robot", "content": "x"}]),
            "messages[0].role", "Invalid enum value 'robot'")
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    rejects(parse_chat_request, body(model="m", messages=[{"role": "user", "content": "x", "tool_calls": [call]}]),
            "messages[0].tool_calls", "only an assistant message has tool_calls")
    history = parse_chat_request(body(model="m", messages=[
        {"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}])).template_messages()
    assert history[1]["tool_calls"][0]["function"]["arguments"] == {} and history[2]["tool_call_id"] == "c1"
    rejects(parse_chat_request, body(model="m", messages=[{"role": "user", "content": "x"}], tool_choice="required"),
            "tool_choice", "needs tools")
    rejects(parse_chat_request, body(model="m", messages=[{"role": "user"}]), "messages[0].content", "required")
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    rejects(parse_chat_request, body(model="m", messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this"}, image]}]), "messages[0].content[1]", "text only")
    rejects(parse_chat_request, chat(tools=[{"type": "function"}]), "tools[0].function", "Missing required parameter")
    rejects(parse_chat_request, chat(n=0), "n", "Expected `int` >= 1")


def test_an_answer_sent_back_as_the_client_parsed_it_is_the_next_turns_history():
    call = ResponseToolCall("c1", ResponseFunction("f", '{"x": 1}'))
    answers = [ChatResponseMessage("Hi."), ChatResponseMessage(None, tool_calls=[call])]
    resent = [ChatCompletion.model_validate_json(msgspec.json.encode(ChatCompletionResponse(
        id="c", created=1, model="m", choices=[ChatChoice(index=0, message=answer, finish_reason="stop")])))
        .choices[0].message.model_dump(exclude_unset=True) for answer in answers]  # as the client sends it
    assert resent[0] == {"content": "Hi.", "refusal": None, "role": "assistant"}
    req = parse_chat_request(body(model="m", messages=[{"role": "user", "content": "x"}, *resent, {
        "role": "tool", "tool_call_id": "c1", "content": "2"}, {"role": "assistant", "content": None,
        "refusal": "I can't.", "annotations": [], "audio": None, "function_call": None}]))
    history = req.template_messages()
    assert [m["content"] for m in history] == ["x", "Hi.", "", "2", "I can't."]
    assert history[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}
    for field, value in (("refusal", "no"), ("annotations", [{"type": "url_citation"}])):
        rejects(parse_chat_request, body(model="m", messages=[{"role": "user", "content": "x", field: value}]),
                f"messages[0].{field}", f"only an assistant message has {field}")
    rejects(parse_chat_request, body(model="m", messages=[{"role": "assistant", "content": "x", "audio": {"id": "a"}}]),
            "messages[0].audio", "Expected `null`")




async def test_answers_from_the_clients_parse_and_stream_helpers_are_the_next_turns_history():
    """``parse()`` adds ``parsed`` and ``parsed_arguments`` to what it returns, ``stream()``'s
    accumulator each call's ``index``: appended as returned, the next turn was a 400 naming them."""
    from pydantic import BaseModel

    class City(BaseModel):
        name: str

    histories = []

    async def chat(request: web.Request) -> web.StreamResponse:
        try:
            req = parse_chat_request(await request.read())
        except OpenAIError as err:
            return err.to_response()
        histories.append(req.template_messages())
        call = ("c1", "City", '{"name": "Rome"}')
        if not req.stream:
            message = ChatResponseMessage('{"name": "Oslo"}', tool_calls=[ResponseToolCall(call[0], ResponseFunction(*call[1:]))])
            return json_response(ChatCompletionResponse(id="c", created=1, model="m", choices=[
                ChatChoice(index=0, message=message, finish_reason="tool_calls")]))
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        for delta, finish in ((ChatDelta(role="assistant", content='{"name": "Oslo"}'), None),
                              (ChatDelta(tool_calls=[DeltaToolCall(0, call[0], "function", DeltaFunction(*call[1:]))]),
                               "tool_calls")):
            await resp.write(sse_event(ChatCompletionChunk(id="c", created=1, model="m",
                                                           choices=[ChatStreamChoice(0, delta, finish_reason=finish)])))
        await resp.write(SSE_DONE)
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0)
    try:
        asked = dict(model="m", response_format=City, tools=[openai.pydantic_function_tool(City)])
        messages = [{"role": "user", "content": "a city"}]
        parsed = (await client.chat.completions.parse(messages=messages, **asked)).choices[0].message
        assert parsed.parsed == City(name="Oslo") and parsed.tool_calls[0].function.parsed_arguments == City(name="Rome")
        messages += [parsed, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
        async with client.chat.completions.stream(messages=messages, **asked) as stream:
            streamed = (await stream.get_final_completion()).choices[0].message
        assert streamed.tool_calls[0].index == 0
        messages += [streamed, {"role": "tool", "tool_call_id": "c1", "content": "rainy"}]
        await client.chat.completions.create(model="m", messages=messages)
    finally:
        await client.close()
        await server.close()
    assert [m["content"] for m in histories[-1]] == ["a city", '{"name": "Oslo"}', "sunny", '{"name": "Oslo"}', "rainy"]
    assert histories[-1][3]["tool_calls"][0]["function"] == {"name": "City", "arguments": {"name": "Rome"}}
