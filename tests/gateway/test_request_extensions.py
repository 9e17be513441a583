"""The fields OpenAI and vLLM document beyond the common ones (gateway/request_extensions.py): each
honoured or accepted where the peer accepts it, a 400 naming it where its value asks for what is not
offered; fields OpenAI's schema lets a client send as null read as their defaults; the request's id
as the client names it."""
from __future__ import annotations

import json

import pytest

from gateway.openai_protocol import OpenAIError, parse_chat_request, parse_completion_request
from gateway.request_extensions import added_bos, answer_id, client_request_id, echoed_prompt, truncated
from gateway.responses_request import parse_responses_request
from tests.support.request_bodies import chat, completion, rejects

PARSERS = {"completion": (parse_completion_request, completion), "chat": (parse_chat_request, chat)}

ACCEPTED = [  # (field, value) a peer's client sends: the request parses
    ("skip_special_tokens", False), ("include_stop_str_in_output", True), ("add_special_tokens", True),
    ("truncate_prompt_tokens", 8), ("truncate_prompt_tokens", -1), ("request_id", "my-req-1"),
    ("spaces_between_special_tokens", False), ("length_penalty", 0.5), ("service_tier", "auto"),
    ("prompt_cache_key", "user-42"), ("prediction", {"type": "content", "content": "def f(): pass"}),
    ("reasoning_effort", "low"), ("verbosity", "medium"), ("modalities", ["text"]), ("priority", 0),
    ("priority", -3), ("priority", 7), ("detokenize", True), ("use_beam_search", False), ("return_token_ids", False),
    ("return_tokens_as_token_ids", False)] + [(name, None) for name in (
        "logits_processors", "vllm_xargs", "kv_transfer_params", "bad_words", "allowed_token_ids", "chat_template",
        "documents", "mm_processor_kwargs", "web_search_options", "audio", "functions", "function_call",
        "skip_special_tokens", "request_id", "priority", "echo")]

REFUSED = [  # (field, value, what the 400 says)
    ("detokenize", False, "detokenize: false"),
    ("use_beam_search", True, "beam search"), ("return_token_ids", True, "no token ids"),
    ("return_tokens_as_token_ids", True, "by their text"), ("modalities", ["text", "audio"], "text only"),
    ("truncate_prompt_tokens", 0, "k >= 1"), ("truncate_prompt_tokens", -2, "Expected `int` >= -1"),
    ("request_id", "has space", "Expected `str` matching"), ("request_id", "x" * 129, "length <= 128"),
    ("logits_processors", ["pkg.mod:Proc"], "Expected `null`"), ("chat_template", "{{ x }}", "Expected `null`"),
    ("bad_words", ["x"], "Expected `null`"), ("functions", [{"name": "f"}], "Expected `null`"),
    ("reasoning_effort", "extreme", "Invalid enum value"), ("service_tier", "bogus", "Invalid enum value")]


@pytest.mark.parametrize("kind", PARSERS)
@pytest.mark.parametrize("field, value", ACCEPTED)
def test_a_field_a_peer_accepts_is_accepted(kind, field, value):
    parse, body = PARSERS[kind]
    if field == "echo" and kind == "completion":
        value = False
    parse(body(**{field: value}))


@pytest.mark.parametrize("kind", PARSERS)
@pytest.mark.parametrize("field, value, says", REFUSED)
def test_a_value_asking_for_what_is_not_offered_is_a_400_naming_its_field(kind, field, value, says):
    parse, body = PARSERS[kind]
    rejects(parse, body(**{field: value}), field, says)


def test_a_chat_may_not_ask_for_its_last_message_repeated():
    rejects(parse_chat_request, chat(echo=True), "echo", "does not repeat the last message")
    assert parse_completion_request(completion(echo=True)).echo  # (a completion's echo is its own field)


@pytest.mark.parametrize("kind, field, default", [
    ("completion", "stream", False), ("completion", "n", 1), ("completion", "echo", False),
    ("completion", "store", False), ("completion", "ignore_eos", False), ("completion", "min_tokens", 0),
    ("completion", "max_tokens", 16), ("chat", "max_tokens", None), ("chat", "stream", False), ("chat", "n", 1), ("chat", "logprobs", False), ("chat", "store", False),
    ("chat", "parallel_tool_calls", True), ("chat", "add_generation_prompt", True),
    ("chat", "continue_final_message", False)])
def test_a_field_sent_as_null_reads_as_its_default(kind, field, default):
    parse, body = PARSERS[kind]
    assert getattr(parse(body(**{field: None})), field) == default
    options = parse(body(stream=True, stream_options={"include_usage": None, "continuous_usage_stats": None}))
    assert not options.sampling().include_usage


def test_responses_accept_what_openai_documents_and_read_nulls_as_defaults():
    call = parse_responses_request(json.dumps({
        "model": "m", "input": "hi", "service_tier": "auto", "prompt_cache_key": "k", "reasoning": {"effort": "low"},
        "text": {"verbosity": "low"}, "stream": None, "parallel_tool_calls": None, "background": None,
        "ignore_eos": None, "min_tokens": None}).encode())
    parse_responses_request(json.dumps({"model": "m", "input": "hi", "stream": True,
                                        "stream_options": {"include_usage": True}}).encode())  # (aiperf's)
    assert (call.chat.stream, call.chat.parallel_tool_calls, call.background) == (False, True, False)


def test_continuous_usage_needs_include_usage_as_in_vllm():
    both = {"include_usage": True, "continuous_usage_stats": True}
    assert parse_chat_request(chat(stream=True, stream_options=both)).sampling().continuous_usage
    alone = {"continuous_usage_stats": True}
    assert not parse_chat_request(chat(stream=True, stream_options=alone)).sampling().continuous_usage


def test_special_tokens_and_stop_strings_reach_the_options():
    options = parse_completion_request(completion(skip_special_tokens=False, include_stop_str_in_output=True)).sampling()
    assert (options.skip_special_tokens, options.include_stop) == (False, True)
    options = parse_completion_request(completion()).sampling()
    assert (options.skip_special_tokens, options.include_stop) == (True, False)


def test_truncation_keeps_the_prompts_last_tokens():
    ids = list(range(10))
    assert truncated(ids, None, 100, 16) is ids and truncated(ids, 3, 100, 16) == [7, 8, 9]
    assert truncated(ids, 20, 100, 16) == ids and truncated(ids, 5, 4, 16) == [6, 7, 8, 9]  # (the context's worth)
    assert truncated(ids, -1, 6, 2) == [6, 7, 8, 9] and truncated(ids, -1, 6, None) == [5, 6, 7, 8, 9]  # beside the output
    assert truncated(ids, -1, 6, 10) == [9]  # (one at least)
    assert truncated(ids, 3, 100, 16, lead=1) == [0, 8, 9]  # the BOS the tokenizer added stays first (vLLM's)
    assert truncated(ids, 1, 100, 16, lead=1) == [9] and truncated([0, 1], 3, 100, 16, lead=1) == [0, 1]

    class Tokenizer:
        bos_token_id = 2

    assert added_bos(Tokenizer(), "The sky is", [2, 9917, 563]) == 1  # (Gemma's)
    assert added_bos(Tokenizer(), "The sky is", [9917, 563]) == 0 and added_bos(Tokenizer(), [2, 5], [2, 5]) == 0


def test_a_cut_text_prompt_echoes_the_text_it_kept_without_the_bos_its_tokenizer_added(tmp_path):
    """echo with truncate_prompt_tokens: the kept tokens' text (it was ``<bos>`` and that text), as the
    whole prompt's echo has no BOS; token ids echo every token, the client's BOS too (vLLM's)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    from tests.support.checkpoints import write_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(write_tokenizer(tmp_path))
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    prompt = "Hello world! Streaming tokens to many concurrent clients"
    whole = tokenizer(prompt).input_ids
    lead = added_bos(tokenizer, prompt, whole)
    assert lead == 1 and len(whole) > 4
    cut = truncated(whole, 3, 100, 16, lead=lead)
    assert echoed_prompt(tokenizer, prompt, whole, cut, lead) == tokenizer.decode(whole[-2:])
    assert prompt.endswith(echoed_prompt(tokenizer, prompt, whole, cut, lead))
    assert echoed_prompt(tokenizer, prompt, whole, truncated(whole, 1, 100, 16, lead=lead), lead) == \
        tokenizer.decode(whole[-1:])
    assert echoed_prompt(tokenizer, prompt, whole, whole, lead) == prompt  # served whole: as sent
    ids = [1] + whole[-3:]
    assert echoed_prompt(tokenizer, ids, ids, ids, 0) == "<bos>" + tokenizer.decode(whole[-3:])


def test_the_client_names_the_answer_by_header_first_then_by_field():
    req = parse_completion_request(completion(request_id="from-body"))
    assert client_request_id({}, req) == "from-body" and answer_id({}, req, "cmpl") == "cmpl-from-body"
    assert answer_id({"X-Request-Id": "from-header"}, req, "cmpl") == "cmpl-from-header"
    assert answer_id({}, parse_completion_request(completion()), "cmpl") is None
    for bad in ("", "a b", "x" * 129, "caf\u00e9"):
        with pytest.raises(OpenAIError) as info:
            client_request_id({"X-Request-Id": bad}, req)
        assert info.value.param == "X-Request-Id"
