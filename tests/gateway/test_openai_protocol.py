"""OpenAI protocol structs: strict request validation, response shapes, SSE, errors.

Shapes are checked against the official `openai` client: its pydantic types parse our JSON, and a
tiny aiohttp app built from these helpers is driven by `openai.AsyncOpenAI` (streaming and errors).
"""
from __future__ import annotations

import json
import tracemalloc

import msgspec
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk as OAChatChunk

from gateway.openai_protocol import (
    SSE_DONE, SSE_HEADERS, ChatChoice, ChatCompletionChunk, ChatCompletionResponse, ChatDelta,
    ChatResponseMessage, ChatStreamChoice, CompletionChoice, CompletionChunk, CompletionResponse,
    ModelCard, ModelList, OpenAIError, Usage, error_response, json_response, new_request_id,
    parse_chat_request, parse_completion_request, sse_event,
)
from gateway.prompt_input import decode_prompt


from tests.support.request_bodies import body, chat, completion, many, rejects, rejects_lightly, with_fields


# ---- requests -----------------------------------------------------------------------------------

def test_completion_defaults_and_normalised_sampling():
    req = parse_completion_request(completion())
    s = req.sampling()
    assert (req.prompt, s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (["Hello"], 16, 1.0, 1.0, None, None)
    assert (s.stop, s.ignore_eos, s.logprobs, s.stream, s.include_usage) == ((), False, None, False, False)

    req = parse_completion_request(completion(
        prompt=[1, 2, 3], max_tokens=5, temperature=0, top_p=0.9, top_k=40, seed=7, stop="\n\n",
        stream=True, stream_options={"include_usage": True}, ignore_eos=True, logprobs=2, user="u1",
        presence_penalty=0, frequency_penalty=0.0, n=1, best_of=1))
    s = req.sampling()
    assert req.prompt == [[1, 2, 3]]
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (5, 0.0, 0.9, 40, 7)
    assert (s.stop, s.ignore_eos, s.logprobs, s.stream, s.include_usage) == (("\n\n",), True, 2, True, True)
    # vLLM-style "disabled" top_k values.
    assert parse_completion_request(completion(top_k=-1)).sampling().top_k is None
    assert parse_completion_request(completion(top_k=0)).sampling().top_k is None
    assert parse_completion_request(completion(max_tokens=None)).sampling().max_tokens == 16  # OpenAI's default


def test_penalties_and_min_p_are_accepted_and_defaulted():
    s = parse_completion_request(completion()).sampling()
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p) == (0.0, 0.0, 1.0, 0.0)
    s = parse_chat_request(chat(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2,
                                min_p=0.05)).sampling()
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p) == (0.5, -1.0, 1.2, 0.05)


def test_prompt_forms():
    """A prompt is one or a batch: text, token ids, or a list of either."""
    assert parse_completion_request(completion(prompt="one string")).prompt == ["one string"]
    assert parse_completion_request(completion(prompt=["one string"])).prompt == ["one string"]
    assert parse_completion_request(completion(prompt=["a", "b"])).prompt == ["a", "b"]
    assert parse_completion_request(completion(prompt=[[1, 2], [3]])).prompt == [[1, 2], [3]]
    assert parse_completion_request(completion(prompt=[[1, 2]], n=2)).prompt == [[1, 2]]
    rejects(parse_completion_request, completion(prompt=[1, "a"]), "prompt", "prompt[1]: Expected `int`")
    rejects(parse_completion_request, completion(prompt=[]), "prompt", "must not be empty")
    rejects(parse_completion_request, completion(prompt=""), "prompt", "must not be empty")
    rejects(parse_completion_request, completion(prompt=[5, -1]), "prompt", "prompt[1]: Expected `int` >= 0")
    rejects(parse_completion_request, completion(prompt=7), "prompt", "a string, a list of token ids")
    rejects(parse_completion_request, completion(prompt={"a": 1}), "prompt", "a string, a list of token ids")
    rejects(parse_completion_request, completion(prompt=["a", 1]), "prompt", "prompt[1]: Expected `str`")
    rejects(parse_completion_request, completion(prompt=[[1], "a"]), "prompt", "prompt[1]: Expected `array`")
    rejects(parse_completion_request, completion(prompt=[[[1]]]), "prompt", "prompt[0][0]: Expected `int`")
    rejects(parse_completion_request, completion(prompt=[""]), "prompt", "prompt[0] must not be empty")
    rejects(parse_completion_request, completion(prompt=["a", ""]), "prompt", "prompt[1] must not be empty")
    rejects(parse_completion_request, completion(prompt=[[1], []]), "prompt", "prompt[1] must not be empty")
    assert parse_completion_request(b'{"model": "m", "prompt": [ \n 3 , 4 ]}').prompt == [[3, 4]]


def test_a_batch_holds_at_most_32_choices():
    """Prompts times n: 32 at most, named as the batch's size or as n."""
    strings, lists = [f"p{i}" for i in range(32)], [[i] for i in range(32)]
    assert parse_completion_request(completion(prompt=strings)).prompt == strings
    assert parse_completion_request(completion(prompt=lists)).prompt == lists
    assert parse_completion_request(completion(prompt=strings[:2], n=16)).prompt == strings[:2]
    rejects(parse_completion_request, completion(prompt=strings + ["one more"]), "prompt", "at most 32 prompts")
    rejects(parse_completion_request, completion(prompt=lists + [[1]]), "prompt", "at most 32 prompts")
    rejects(parse_completion_request, completion(prompt=strings[:3], n=11), "n", "its 3 prompts times n=11")
    # A batch's token-id lists are each held to the context, before any id is decoded.
    with pytest.raises(OpenAIError, match=r"prompt\[1\] has 9 tokens") as info:
        parse_completion_request(completion(prompt=[[1], [2] * 9]), max_prompt_tokens=8)
    assert info.value.param == "prompt" and info.value.code == "context_length_exceeded"
    # Escaped quotes and commas inside a batch's strings are no boundaries.
    assert parse_completion_request(completion(prompt=['a ", "b', "c\\"])).prompt == ['a ", "b', "c\\"]


def test_a_prompt_is_read_past_leading_whitespace():
    """``decode_prompt`` takes JSON as it may come, whitespace before the value included."""
    assert decode_prompt(msgspec.Raw(b" \n [1, 2]"), 8) == [[1, 2]]
    assert decode_prompt(msgspec.Raw(b'  ["text"]'), 8) == ["text"]
    assert decode_prompt(msgspec.Raw(b"\t[ [1], \n [2]]"), 8) == [[1], [2]]
    assert decode_prompt(msgspec.Raw(b'[ "a" ,\n"b" ]'), 8) == ["a", "b"]


# Bodies that cost the gateway's event loop over a second each when ``prompt`` was ``str | list[Any]``
# (decoded into Python objects, then walked).  Each is refused, naming the prompt, without building
# an object per element: what it allocates stays below twice the body (a copy of the prompt's bytes
# at most; the old decoding peaked at 16-158 MiB for these 4 MiB bodies).
MIB = 1 << 20


def filler(item: bytes, size: int = 4 * MIB - 64) -> bytes:
    return b",".join([item] * (size // (len(item) + 1)))


@pytest.mark.parametrize("prompt,text", [
    (b"[" + filler(b"[1,2,3,4,5,6,7,8]") + b"]", "at most 32 prompts"),
    (b"[" + filler(b"[[[[[[[[1]]]]]]]]") + b"]", "at most 32 prompts"),
    (b"[" + filler(b'"a"') + b"]", "at most 32 prompts"),
    (b'["' + b"a" * (4 * MIB - 128) + b'", 1]', "prompt[1]: Expected `str`"),
    (b"[[1]," + filler(b"1", 4 * MIB - 128) + b"]", "prompt[1]: Expected `array`"),
    (b"[[" + filler(b"1") + b"]]", "prompt[0] has"),
    (b"[1," + filler(b"[1]") + b"]", "comma-separated parts"),
    (b"[" + filler(b"1") + b"]", "maximum context length is 4096 tokens"),
    (b"[" + filler(b"1.0") + b"]", "maximum context length is 4096 tokens"),
    # Counted by their commas though a string follows (it once skipped the count: 24.5 MiB of ints).
    (b"[" + filler(b"1000000", 4 * MIB - 128) + b', "1"]', "maximum context length is 4096 tokens"),
])
def test_hostile_prompts_are_refused_naming_the_prompt(prompt, text):
    raw = b'{"model": "m", "prompt": ' + prompt + b"}"
    assert len(raw) <= 4 * MIB
    tracemalloc.start()
    try:
        with pytest.raises(OpenAIError) as info:
            parse_completion_request(raw, max_prompt_tokens=4096)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.status == 400 and info.value.param == "prompt" and text in info.value.message, info.value.message
    assert peak < 2 * len(raw), f"decoding the prompt allocated {peak / MIB:.1f} MiB"


DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("parse,raw,param", [
    (parse_completion_request, b'{"model": "m", "prompt": ' + DEEP + b"}", "prompt"),
    (parse_completion_request, b'{"model": "m", "prompt": [1, ' + DEEP + b"]}", "prompt"),
    (parse_completion_request, b'{"model": "m",\n "user" : "u", "prompt": "x", "stop": ' + DEEP + b"}", "stop"),
    (parse_chat_request, b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x", '
                         b'"extra": ' + DEEP + b"}]}]}", "messages"),
])
def test_deeply_nested_json_is_a_400_naming_the_field(parse, raw, param):
    with pytest.raises(OpenAIError) as info:
        parse(raw)
    assert info.value.status == 400, info.value.message
    assert "nested too deeply" in info.value.message and info.value.code == "json_too_deep", info.value.message
    assert info.value.param == param


PART = b'{"type": "text", "text": "x"}'
# 38 parts a message: the parts of the first 108 messages are more than 4096 in all.
SPREAD = b"[" + b",".join([b'{"role": "user", "content": [' + b",".join([PART] * 38) + b"]}"] * 3000) + b"]"
LOGIT_BIAS = b"{" + b",".join(b'"%d": -100' % i for i in range(280_000)) + b"}"


@pytest.mark.parametrize("parse,field,value,param,text", [
    (parse_completion_request, "logit_bias", LOGIT_BIAS, "logit_bias", "at most 300 entries"),
    (parse_chat_request, "logit_bias", LOGIT_BIAS, "logit_bias", "at most 300 entries"),
    (parse_chat_request, "response_format", b'{"type": "json_schema", "json_schema": {"schema": ' + many(b"1") + b"}}",
     "response_format", "at most 262144 are allowed"),
    (parse_chat_request, "structured_outputs", b'{"choice": ' + many(b'"a"') + b"}", "structured_outputs",
     "at most 262144 are allowed"),
    (parse_completion_request, "stop", many(b'"ab"'), "stop", "at most length 16"),
    (parse_chat_request, "stop", many(b'"ab"'), "stop", "at most length 16"),
    (parse_chat_request, "messages", many(b'{"role": "user", "content": ""}'), "messages", "at most length 4096"),
    (parse_chat_request, "messages", b'[{"role": "user", "content": ' + many(PART) + b"}]", "messages[0].content",
     "at most length 64"),
    (parse_chat_request, "messages", SPREAD, "messages[107].content", "at most 4096 content parts in all"),
    (parse_chat_request, "metadata", b"{" + b",".join(b'"k%d": "v"' % i for i in range(200_000)) + b"}", "metadata",
     "at most 131072 are allowed (16 pairs)"),
])
def test_hostile_lists_are_refused_before_their_elements_are_decoded(parse, field, value, param, text):
    """Fields other than the prompt that a 4 MiB body can fill with hundreds of thousands of
    elements are refused, naming the field, without building an object per element (decoding
    them first cost 40-260 ms of the event loop each, or let 155k content parts through)."""
    fields = {"model": b'"m"', "prompt": b'"x"'} if parse is parse_completion_request else {
        "model": b'"m"', "messages": b'[{"role": "user", "content": "x"}]'}
    fields[field] = value
    rejects_lightly(parse, with_fields(fields), param, text, field)


def test_max_tokens_0_is_the_prompt_alone_with_echo():
    assert parse_completion_request(completion(max_tokens=0, echo=True, logprobs=1)).sampling().max_tokens == 0
    rejects(parse_completion_request, completion(max_tokens=0), "max_tokens", "it needs echo")
    rejects(parse_chat_request, chat(max_tokens=0), "max_tokens", ">= 1")


def test_prompt_logprobs_are_ranged_and_not_streamed():
    assert parse_completion_request(completion(prompt_logprobs=0)).sampling().prompt_logprobs == 0
    assert parse_chat_request(chat(prompt_logprobs=20)).sampling().prompt_logprobs == 20
    rejects(parse_completion_request, completion(prompt_logprobs=21), "prompt_logprobs", "<= 20")
    rejects(parse_chat_request, chat(prompt_logprobs=1, stream=True), "prompt_logprobs", "not streamed")


def test_unknown_fields_are_rejected_by_name():
    err = rejects(parse_completion_request, completion(tools=[]), "tools", "Unrecognized request argument supplied: tools")
    assert err.code == "unknown_parameter"
    rejects(parse_chat_request, chat(response_format={"type": "json_object", "strict": True}), "response_format.strict",
            "Unrecognized request argument supplied: response_format.strict")
    rejects(parse_chat_request, body(model="m", messages=[{"role": "user", "content": "x", "tool_call_id": "1"}]),
            "messages[0].tool_call_id", "tool_call_id")
    rejects(parse_completion_request, completion(stream=True, stream_options={"include_usage": True, "x": 1}),
            "stream_options.x", "Unrecognized")
    # vLLM's removed guided_* fields are refused naming what replaced them (vLLM ignores them now).
    rejects(parse_completion_request, completion(guided_json={"type": "object"}), "guided_json",
            'send structured_outputs: {"json": ...}')
    rejects(parse_chat_request, chat(guided_choice=["a", "b"]), "guided_choice", 'structured_outputs: {"choice": ...}')


@pytest.mark.parametrize("field,value,text", [
    ("temperature", 2.5, "<= 2.0"),
    ("temperature", -0.1, ">= 0.0"),
    ("top_p", 0, "> 0.0"),
    ("top_p", 1.5, "<= 1.0"),
    ("max_tokens", 0, ">= 1"),
    ("max_tokens", 1.5, "Expected `int | null`, got `float`"),
    ("logprobs", 21, "<= 20"),
    ("top_k", -2, "top_k must be >= 1"),
    ("seed", 2**64, "seed must fit"),
    ("stream", "yes", "Expected `bool | null`"),
    ("presence_penalty", 3, "<= 2.0"),
    ("frequency_penalty", -2.5, ">= -2.0"),
    ("repetition_penalty", 0, "> 0.0"),
    ("repetition_penalty", 11, "<= 10.0"),
    ("min_p", 1.5, "<= 1.0"),
    ("min_p", -0.1, ">= 0.0"),
    ("user", "u" * 300, "length <= 256"),
])
def test_range_errors_name_the_parameter(field, value, text):
    rejects(parse_completion_request, completion(**{field: value}), field, text)


def test_integral_numbers_are_integers_as_in_json_schema():
    """16.0 is an integer (JSON Schema's, the OpenAPI document's, and OpenAI's / vLLM's servers');
    16.5 is not.  Numbers and booleans sent as strings are read too (as pydantic-based servers do)."""
    req = parse_completion_request(completion(prompt=[1.0, 2, 3.0], max_tokens=16.0, seed=7.0, stream="true"))
    assert req.prompt == [[1, 2, 3]] and all(type(t) is int for t in req.prompt[0])
    assert (req.max_tokens, req.seed, req.stream) == (16, 7, True)
    assert parse_completion_request(completion(max_tokens="5", temperature="0.5")).sampling().max_tokens == 5
    rejects(parse_completion_request, completion(prompt=[1.5, 2]), "prompt", "list of token ids (integers in")
    rejects(parse_completion_request, completion(prompt=[1e30]), "prompt", "list of token ids (integers in")
    rejects(parse_completion_request, completion(prompt=[True, 2]), "prompt", "a string, a list of token ids")
    assert parse_chat_request(chat(max_completion_tokens=8.0, top_logprobs=2.0, logprobs=True)).sampling().logprobs == 2


@pytest.mark.parametrize("field,value,text", [
    ("n", 17, "Expected `int` <= 16"),
    ("best_of", 17, "Expected `int` <= 16"),
    ("suffix", "tail", "suffix is not supported"),
    ("store", True, "stored completions are not supported"),
])
def test_unsupported_features_are_rejected_clearly(field, value, text):
    err = rejects(parse_completion_request, completion(**{field: value}), field, text)
    assert err.to_response().status == 400


def test_stop_strings_are_bounded():
    assert parse_completion_request(completion(stop=["a", "bc"])).sampling().stop == ("a", "bc")
    rejects(parse_completion_request, completion(stop=[str(i) for i in range(17)]), "stop", "at most length 16")
    rejects(parse_completion_request, completion(stop=[""]), "stop", "1-256 characters")
    rejects(parse_completion_request, completion(stop="x" * 257), "stop", "1-256 characters")
    rejects(parse_completion_request, completion(stop=[1]), "stop[0]", "Expected `str`")


def test_bounded_fields_accept_what_they_always_did():
    """Kept as raw JSON until checked, the bounded fields still take every value they took."""
    for parse, make in ((parse_completion_request, completion), (parse_chat_request, chat)):
        assert parse(make(logit_bias=None)).logit_bias is None
        assert parse(make(logit_bias={})).sampling().logit_bias == ()
        assert parse(b'{"model": "m", "logit_bias": { \n }, ' + make()[1:]).sampling().logit_bias == ()
        assert parse(make(logit_bias={"7": 100, "3": -1.5})).sampling().logit_bias == ((3, -1.5), (7, 100.0))
        # 300 entries, however the client spaces them or however long its numbers are
        full = {str(100_000 + i): -12.345678901234567 for i in range(300)}
        indented = json.dumps({**json.loads(make()), "logit_bias": full}, indent=8).encode()
        assert len(parse(indented).sampling().logit_bias) == 300
        spaced = make(logit_bias={"7": 1}).replace(b'"logit_bias": {', b'"logit_bias": {' + b" " * 12_000)
        assert parse(spaced).sampling().logit_bias == ((7, 1.0),)
        assert parse(make(stop=None)).sampling().stop == ()
        assert parse(make(stop=[str(i) for i in range(16)])).sampling().stop == tuple(str(i) for i in range(16))
        rejects(parse, make(stop=["a", None]), "stop[1]", "Expected `str`, got `null`")
        rejects(parse, make(stop={"a": 1}), "stop", "Expected `str | array`, got `object`")
    part = {"type": "text", "text": "x"}
    req = parse_chat_request(body(model="m", messages=[{"role": "user", "content": [part] * 64}] * 64))
    assert len(req.messages) == 64 and req.template_messages()[0]["content"] == "\n".join(["x"] * 64)
    rejects(parse_chat_request, body(model="m", messages=[{"role": "user", "content": [part] * 65}]),
            "messages[0].content", "at most length 64")
    rejects(parse_chat_request, body(model="m", messages=[{"role": "user", "content": [part] * 64}] * 65),
            "messages[64].content", "at most 4096 content parts in all")
    rejects(parse_chat_request, body(model="m", messages=[{"role": "user", "content": None}]),
            "messages[0].content", "required")
    rejects(parse_chat_request, body(model="m", messages=[{"role": "user", "content": "x"}, 5]),
            "messages[1]", "Expected `object`, got `int`")


def test_stream_options_need_stream():
    rejects(parse_completion_request, completion(stream_options={"include_usage": True}), "stream_options",
            "only allowed when stream is true")
    assert not parse_chat_request(chat(stream=True)).sampling().include_usage


def test_malformed_bodies():
    rejects(parse_completion_request, b"{not json", None, "not valid JSON")
    rejects(parse_completion_request, b"[1, 2]", None, "Expected `object`")
    rejects(parse_completion_request, b"", None, "not valid JSON")
    # msgspec calls a lone high surrogate "truncated input": the refusal says what it is
    lone = rejects(parse_chat_request, rb'{"model": "m", "messages": [{"role": "user", "content": "a\ud800b"}]}',
                   None, "not valid JSON")
    assert "\\ud800 at byte 58 is a lone UTF-16 high surrogate" in lone.message, lone.message
    assert "truncated" in rejects(parse_chat_request, b'{"model": "m', None, "not valid JSON").message
    for text in (rb"H\ud800i", rb"H\ud800\u0041", rb"H\ud800"):  # whatever follows it
        refused = rejects(parse_completion_request, completion(prompt="P").replace(b'"P"', b'"' + text + b'"'),
                          None, "not valid JSON")
        assert "lone UTF-16 high surrogate" in refused.message, (text, refused.message)
    escaped = rejects(parse_completion_request, completion(prompt="P").replace(b'"P"', b'"\\\\ud800'), None, "")
    assert "surrogate" not in escaped.message  # (a backslash, then text: the body is only cut short)
    err = rejects(parse_completion_request, body(prompt="x"), "model", "Missing required parameter: 'model'")
    assert err.code == "missing_required_parameter"
    rejects(parse_chat_request, body(model="m"), "messages", "Missing required parameter")


# ---- responses, checked with the official client's types ----------------------------------------

def test_completion_response_matches_openai_types():
    resp = CompletionResponse(
        id=new_request_id("cmpl"), created=1700000000, model="m",
        choices=[CompletionChoice(index=0, text=" world", finish_reason="stop", stop_reason="\n")],
        usage=Usage.of(5, 2, cached_tokens=4))
    raw = msgspec.json.encode(resp)
    parsed = Completion.model_validate_json(raw)
    assert parsed.object == "text_completion" and parsed.choices[0].text == " world"
    assert parsed.usage.total_tokens == 7 and parsed.usage.prompt_tokens_details.cached_tokens == 4
    assert resp.id.startswith("cmpl-")
    # Without cached_tokens the details object is omitted entirely.
    assert b"prompt_tokens_details" not in msgspec.json.encode(Usage.of(1, 1))


def test_chat_response_and_chunks_match_openai_types():
    resp = ChatCompletionResponse(
        id="chatcmpl-1", created=1, model="m", usage=Usage.of(3, 1),
        choices=[ChatChoice(index=0, message=ChatResponseMessage("Hi!"), finish_reason="length")])
    parsed = ChatCompletion.model_validate_json(msgspec.json.encode(resp))
    assert parsed.choices[0].message.role == "assistant" and parsed.choices[0].message.content == "Hi!"
    assert json.loads(msgspec.json.encode(resp))["choices"][0]["message"]["refusal"] is None  # (a required key)

    first = ChatCompletionChunk(id="c", created=1, model="m",
                                choices=[ChatStreamChoice(index=0, delta=ChatDelta(role="assistant", content=""))])
    last = ChatCompletionChunk(id="c", created=1, model="m",
                               choices=[ChatStreamChoice(index=0, delta=ChatDelta(), finish_reason="stop")])
    usage = ChatCompletionChunk(id="c", created=1, model="m", choices=[], usage=Usage.of(3, 2))
    for chunk in (first, last, usage):
        event = sse_event(chunk)
        assert event.startswith(b"data: {") and event.endswith(b"}\n\n") and b"\n" not in event[:-2]
        OAChatChunk.model_validate_json(event[len(b"data: "):-2])
    assert json.loads(sse_event(last)[6:])["choices"][0]["delta"] == {}
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_models_listing_matches_openai_types():
    listing = ModelList(data=[ModelCard(id="org/m", created=5, max_model_len=4096)])
    raw = json.loads(msgspec.json.encode(listing))
    assert raw["object"] == "list"
    model = Model.model_validate(raw["data"][0])
    assert (model.id, model.object, model.owned_by) == ("org/m", "model", "pdserve")


# ---- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("status,etype,retry", [
    (400, "invalid_request_error", None), (401, "authentication_error", None), (404, "not_found_error", None),
    (413, "invalid_request_error", None), (429, "rate_limit_error", "1"), (503, "service_unavailable_error", "1"),
])
def test_error_responses(status, etype, retry):
    resp = error_response(status, "nope", param="p", code="c")
    assert resp.status == status and resp.content_type == "application/json"
    assert json.loads(resp.body) == {"error": {"message": "nope", "type": etype, "param": "p", "code": "c"}}
    assert resp.headers.get("Retry-After") == retry


def test_retry_after_and_sse_error():
    err = OpenAIError(503, "all decode workers are full", retry_after=4.4)
    assert err.to_response().headers["Retry-After"] == "4"
    assert err.to_sse().startswith(b'data: {"error":{"message":"all decode workers are full"')
    assert err.to_sse().endswith(b"\n\n")


# ---- the official client against a tiny app built from these helpers ----------------------------

async def _completions(request: web.Request) -> web.StreamResponse:
    try:
        req = parse_completion_request(await request.read())
    except OpenAIError as err:
        return err.to_response()
    rid = new_request_id("cmpl")
    if not req.stream:
        return json_response(CompletionResponse(rid, 1, req.model, [CompletionChoice(0, "ok", finish_reason="stop")],
                                                Usage.of(1, 1)))
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    for piece, finish in (("o", None), ("k", "length")):
        await resp.write(sse_event(CompletionChunk(rid, 1, req.model, [CompletionChoice(0, piece, finish_reason=finish)])))
    if req.sampling().include_usage:
        await resp.write(sse_event(CompletionChunk(rid, 1, req.model, [], usage=Usage.of(1, 2))))
    await resp.write(SSE_DONE)
    return resp


async def _busy(request: web.Request) -> web.Response:
    return error_response(429, "too many requests in flight", retry_after=2)


@pytest.fixture
async def openai_client():
    app = web.Application()
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _busy)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0)
    try:
        yield client
    finally:
        await client.close()
        await server.close()


async def test_official_client_roundtrip(openai_client):
    done = await openai_client.completions.create(model="m", prompt="hi", max_tokens=2)
    assert done.choices[0].text == "ok" and done.usage.total_tokens == 2

    stream = await openai_client.completions.create(model="m", prompt="hi", stream=True,
                                                    stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "ok"
    assert chunks[-1].usage.completion_tokens == 2

    with pytest.raises(openai.BadRequestError) as info:
        await openai_client.completions.create(model="m", prompt="hi", n=17)
    assert info.value.body["param"] == "n" and "<= 16" in info.value.body["message"]

    with pytest.raises(openai.RateLimitError) as info:
        await openai_client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert info.value.response.headers["Retry-After"] == "2"


def test_best_of_is_at_least_n_not_streamed_and_bounded_with_the_batch():
    assert parse_completion_request(completion(best_of=4, n=2)).sampling().best_of == 4
    assert parse_completion_request(completion(best_of=2, n=2)).sampling().best_of is None  # (n of n: no ranking)
    rejects(parse_completion_request, completion(best_of=1, n=2), "best_of", "must be at least n")
    rejects(parse_completion_request, completion(best_of=2, stream=True), "best_of", "not streamed")
    rejects(parse_completion_request, completion(best_of=2, prompt=["a"] * 17), "best_of", "are at most 32")
