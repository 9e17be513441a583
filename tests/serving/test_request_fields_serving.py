"""The request fields beyond one plain completion, served: ``n`` (the prompt computed once, the
other choices sharing its blocks; reproducible with a seed), a batch of prompts, ``echo`` (with
``logprobs``: the prompt scored), ``stream_options`` (``include_usage``, ``continuous_usage_stats``),
logprobs on chat and completions including the first token (sampled by the prefill worker),
``stop_token_ids``, ``user`` and ``metadata``."""
from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import openai
import pytest

from tests.support.checkpoints import TRAINING_TEXT
from tests.support.cluster import gateway_metric

LONG = "Fields: " + " ".join(TRAINING_TEXT) * 2  # over --skip-prefill-below: through the prefill pool


def texts(response):
    return [c.text for c in sorted(response.choices, key=lambda c: c.index)]


GATEWAY_COUNTS = ("pdserve_prompt_tokens_total", "pdserve_prefix_cache_hit_tokens_total",
                  "pdserve_time_to_first_token_seconds_count", "pdserve_e2e_request_latency_seconds_count")


def test_n_choices_are_reproducible_with_a_seed_and_share_the_prompt(client, stack):
    prompt = f"{LONG} n choices"
    prefilled, hits = stack.stats("p0")["prefill_computed_tokens"], stack.stats("d0")["prefix_cache_hit_tokens_total"]
    counted = [gateway_metric(stack, name) for name in GATEWAY_COUNTS]
    first = client.completions.create(model=stack.model_name, prompt=prompt, n=3, max_tokens=8, temperature=1.0,
                                      seed=11, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in first.choices) == [0, 1, 2] and len(set(texts(first))) > 1
    assert first.usage.completion_tokens == 24
    # The prompt was computed once (by the prefill worker, for choice 0); choices 1 and 2 found
    # all of it but the last block in the decode worker's cache.
    prompt_tokens = first.usage.prompt_tokens
    assert stack.stats("p0")["prefill_computed_tokens"] - prefilled <= prompt_tokens
    assert stack.stats("d0")["prefix_cache_hit_tokens_total"] - hits >= 2 * (prompt_tokens - 16)
    # The gateway counts the request once: its prompt, its hits (none: a new prompt), one TTFT, one end
    # (the workers' hits above are the choices' sharing; the hit rate is the prompts').
    now = [gateway_metric(stack, name) for name in GATEWAY_COUNTS]
    assert [b - a for a, b in zip(counted, now)] == [prompt_tokens, first.usage.prompt_tokens_details.cached_tokens
                                                     if first.usage.prompt_tokens_details else 0, 1, 1]
    again = client.completions.create(model=stack.model_name, prompt=prompt, n=3, max_tokens=8, temperature=1.0,
                                      seed=11, extra_body={"ignore_eos": True})
    assert texts(again) == texts(first)
    # Choice i is seeded seed + i: choice 1 of seed 11 is choice 0 of seed 12.
    alone = client.completions.create(model=stack.model_name, prompt=prompt, max_tokens=8, temperature=1.0, seed=12,
                                      extra_body={"ignore_eos": True})
    assert alone.choices[0].text == texts(first)[1]


def test_n_choices_of_a_client_gone_before_its_first_token_end_its_request_once(stack):
    """The client leaves while its prompt is computed: its choices' runs, begun or not, end the
    request -- its end-to-end latency observed once (the choices never begun were not counted out)."""
    ended = gateway_metric(stack, "pdserve_e2e_request_latency_seconds_count")
    body = json.dumps({"model": stack.model_name, "prompt": f"{LONG} gone early", "n": 3, "max_tokens": 50,
                       "stream": True}).encode()
    host, port = stack.gateway_url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 60
    while gateway_metric(stack, "pdserve_e2e_request_latency_seconds_count") == ended:
        assert time.monotonic() < deadline, "the request never ended"
        time.sleep(0.1)
    assert gateway_metric(stack, "pdserve_e2e_request_latency_seconds_count") == ended + 1


def test_a_batch_of_prompts_answers_each_as_if_alone(client, stack):
    """A batch's choice p * n + i is choice i of prompt p: greedy, each prompt's text is its text
    alone (strings and token ids); seeded and streamed with n = 2, each prompt's choice i is the
    prompt alone with seed + i; the usage counts each prompt once and every choice's tokens."""
    greedy = {"max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    for prompts in (["batch: one", f"{LONG} batch: two, through the prefill pool", "batch: three"],
                    [[5, 6, 7], [8, 9, 10, 11], [5, 6, 7]]):
        alone = [client.completions.create(model=stack.model_name, prompt=p, **greedy) for p in prompts]
        batch = client.completions.create(model=stack.model_name, prompt=prompts, **greedy)
        assert [c.index for c in batch.choices] == [0, 1, 2]
        assert texts(batch) == [a.choices[0].text for a in alone]
        assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
        assert batch.usage.completion_tokens == 18
    prompts = ["seeded batch: one", "seeded batch: two"]
    sampled = {"max_tokens": 5, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    stream = client.completions.create(model=stack.model_name, prompt=prompts, n=2, seed=5, stream=True,
                                       stream_options={"include_usage": True}, **sampled)
    pieces, finished, usage = {i: "" for i in range(4)}, set(), None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces[choice.index] += choice.text
            finished |= {choice.index} if choice.finish_reason else set()
    assert finished == {0, 1, 2, 3}
    expected = [client.completions.create(model=stack.model_name, prompt=p, seed=5 + i, **sampled)
                for p in prompts for i in range(2)]
    assert [pieces[i] for i in range(4)] == [e.choices[0].text for e in expected]
    assert usage.prompt_tokens == expected[0].usage.prompt_tokens + expected[2].usage.prompt_tokens
    assert usage.completion_tokens == 20


def test_vllm_prompt_logprobs(client, stack, scores):
    """vLLM's ``prompt_logprobs``: entry i maps prompt token i (and its top alternatives, ranked
    1..k) to its logprob, rank and text, the first entry null; a completion choice's, a chat
    response's (the rendered prompt's); not streamed."""
    prompt = [9, 4, 12, 4, 30, 2]
    answer = client.completions.create(model=stack.model_name, prompt=prompt, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 2})
    scored = answer.choices[0].prompt_logprobs
    assert len(scored) == len(prompt) and scored[0] is None and answer.choices[0].logprobs is None
    for entry, token, (logprob, rank) in zip(scored[1:], prompt[1:], scores(prompt, ranks=True)):
        assert entry[str(token)]["logprob"] == pytest.approx(logprob, abs=2e-3) and entry[str(token)]["rank"] == rank
        # the top 2 ranked 1 and 2, and the prompt token besides when it is not among them
        assert {1, 2} <= {v["rank"] for v in entry.values()} and len(entry) == (2 if rank <= 2 else 3)
    chat = client.chat.completions.create(model=stack.model_name, messages=[{"role": "user", "content": "scored chat"}],
                                          max_tokens=2, extra_body={"prompt_logprobs": 0})
    assert len(chat.prompt_logprobs) == chat.usage.prompt_tokens and chat.prompt_logprobs[0] is None
    assert all(len(entry) == 1 for entry in chat.prompt_logprobs[1:])
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=stack.model_name, prompt=prompt, max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert info.value.body["param"] == "prompt_logprobs"


def test_n_streamed_chat_carries_every_index(client, stack):
    stream = client.chat.completions.create(model=stack.model_name, messages=[{"role": "user", "content": "n stream"}],
                                            n=2, max_tokens=5, temperature=1.0, seed=3, stream=True,
                                            stream_options={"include_usage": True})
    pieces, finished, usage = {0: "", 1: ""}, set(), None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and usage.completion_tokens >= 2
    whole = client.chat.completions.create(model=stack.model_name, messages=[{"role": "user", "content": "n stream"}],
                                           n=2, max_tokens=5, temperature=1.0, seed=3)
    assert [whole.choices[i].message.content for i in (0, 1)] == [pieces[0], pieces[1]]


def test_echo_streamed_and_not(client, stack):
    whole = client.completions.create(model=stack.model_name, prompt="Echo me", max_tokens=4, temperature=0, echo=True)
    assert whole.choices[0].text.startswith("Echo me") and len(whole.choices[0].text) > len("Echo me")
    stream = client.completions.create(model=stack.model_name, prompt="Echo me", max_tokens=4, temperature=0, echo=True,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == whole.choices[0].text


@pytest.fixture(scope="module")
def scores(served_checkpoint):
    """The log-softmax of transformers' logits over a prompt (the served checkpoint, fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(served_checkpoint, dtype=torch.float32).eval()

    def run(prompt: list[int], ranks: bool = False) -> list[float] | list[tuple[float, int]]:
        """Entry i: the log-probability of prompt token i + 1 (and its rank: 1 the most likely)."""
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)[:-1]
        chosen = logprobs[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)]
        if not ranks:
            return chosen.tolist()
        return list(zip(chosen.tolist(), (1 + (logprobs > chosen[:, None]).sum(dim=-1)).tolist()))

    return run


def test_echo_with_logprobs_scores_the_prompt(client, stack, scores):
    """What lm-eval's loglikelihood requests send (token ids, echo, logprobs, one token): the
    prompt's tokens come first, the first without a logprob, each other's as transformers scores
    it -- a short prompt computed by the decode worker, a long one by the prefill worker (whole,
    though its blocks are cached); streamed, the echo's chunk carries them."""
    short = [7, 3, 11, 5, 9]
    long = post(stack, "/tokenize", {"model": stack.model_name, "prompt": f"{LONG} scored"})[1]["tokens"]
    for prompt in (short, long, long):
        computed = stack.stats("p0")["prefill_computed_tokens"]
        answer = client.completions.create(model=stack.model_name, prompt=prompt, echo=True, logprobs=2, max_tokens=1,
                                           temperature=0, extra_body={"ignore_eos": True})
        logprobs = answer.choices[0].logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(prompt) + 1
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert logprobs.token_logprobs[1:-1] == pytest.approx(scores(prompt), abs=2e-3)
        # each position's top 2 and the token that is there, first (OpenAI's legacy API, vLLM: up to logprobs + 1)
        assert all(len(top) <= 3 and next(iter(top)) == token
                   for top, token in zip(logprobs.top_logprobs[1:], logprobs.tokens[1:]))
        assert logprobs.text_offset == sorted(logprobs.text_offset)  # the answer's go on from the prompt's
        if prompt is long:  # through the prefill pool, every time computed whole
            assert stack.stats("p0")["prefill_computed_tokens"] - computed == len(prompt)
    stream = list(client.completions.create(model=stack.model_name, prompt=short, echo=True, logprobs=2, max_tokens=3,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    echoed = stream[0].choices[0].logprobs
    assert echoed.token_logprobs[0] is None and echoed.token_logprobs[1:] == pytest.approx(scores(short), abs=2e-3)
    # max_tokens=0: the prompt alone, scored (OpenAI's legacy API, vLLM).
    alone = client.completions.create(model=stack.model_name, prompt=short, echo=True, logprobs=2, max_tokens=0,
                                      temperature=0)
    logprobs = alone.choices[0].logprobs
    assert len(logprobs.tokens) == len(short) and logprobs.token_logprobs[1:] == pytest.approx(scores(short), abs=2e-3)
    assert alone.choices[0].text == post(stack, "/detokenize", {"model": stack.model_name, "tokens": short})[1]["prompt"]
    # Without echo, the prompt is not scored.
    plain = client.completions.create(model=stack.model_name, prompt=short, logprobs=2, max_tokens=1, temperature=0)
    assert len(plain.choices[0].logprobs.tokens) == 1
    # Every choice scores its prompt: a request's scores in all are bounded (1000 tokens x 21 values
    # x 7 choices, or 7 prompts, are over 131072).
    for shape in ({"prompt": [5] * 1000, "n": 7}, {"prompt": [[5] * 1000] * 7}):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=stack.model_name, echo=True, logprobs=20, max_tokens=1, **shape)
        assert info.value.body["param"] == "logprobs" and "at most 131072" in info.value.body["message"]


def test_continuous_usage_stats(client, stack):
    stream = client.completions.create(model=stack.model_name, prompt="usage as it goes", max_tokens=6, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True},
                                       stream_options={"include_usage": True, "continuous_usage_stats": True})
    counts = [c.usage.completion_tokens for c in stream if c.usage is not None]
    assert counts == sorted(counts) and counts[-1] == 6 and len(counts) >= 2
    chunks = list(client.chat.completions.create(
        model=stack.model_name, messages=[{"role": "user", "content": "usage"}], max_tokens=3, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks)  # the role's chunk too, before any token (vLLM's)
    assert (chunks[0].choices[0].delta.role, chunks[0].usage.completion_tokens) == ("assistant", 0)
    assert chunks[0].usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 0
    assert chunks[-1].usage.completion_tokens == 3


@pytest.mark.parametrize("prompt", ["short logprobs", LONG])
def test_logprobs_cover_the_first_token_streamed_and_not(client, stack, prompt):
    messages = [{"role": "user", "content": prompt}]
    whole = client.chat.completions.create(model=stack.model_name, messages=messages, max_tokens=5, temperature=0,
                                           logprobs=True, top_logprobs=3).choices[0]
    assert len(whole.logprobs.content) == 5 and all(len(e.top_logprobs) == 3 for e in whole.logprobs.content)
    stream = client.chat.completions.create(model=stack.model_name, messages=messages, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    # The same tokens and log-probabilities; the second request's prompt is a prefix-cache hit,
    # computed by other kernels than the first's fresh prefill: the floats agree to rounding only.
    assert [e.token for e in streamed] == [e.token for e in whole.logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole.logprobs.content], abs=1e-3)
    completion = client.completions.create(model=stack.model_name, prompt=prompt, max_tokens=5, temperature=0,
                                           logprobs=2)
    assert len(completion.choices[0].logprobs.token_logprobs) == 5


def test_stop_token_ids_user_and_metadata(client, stack):
    forced = {"logit_bias": {"77": 100}}  # every token is 77
    runs_on = client.completions.create(model=stack.model_name, prompt="stop ids", max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True}, **forced)
    assert runs_on.choices[0].finish_reason == "length" and runs_on.usage.completion_tokens == 6
    stopped = client.completions.create(model=stack.model_name, prompt="stop ids", max_tokens=6, temperature=0,
                                        user="someone", extra_body={"stop_token_ids": [77], "metadata": {"k": "v"}},
                                        **forced)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    # As in vLLM: the stop token's id is the stop_reason, its text is not the answer's.
    assert (stopped.choices[0].text, stopped.choices[0].stop_reason) == ("", 77), stopped.choices[0]
    chat = client.chat.completions.create(model=stack.model_name, messages=[{"role": "user", "content": "stop ids"}],
                                          max_tokens=6, temperature=0, extra_body={"stop_token_ids": [77]}, **forced)
    assert (chat.choices[0].message.content, chat.choices[0].stop_reason) == ("", 77), chat.choices[0]


def test_min_tokens_holds_stop_strings_back_too(client, stack):
    """As in vLLM: a stop string ends the output only once it has more than ``min_tokens`` tokens."""
    forced = {"logit_bias": {"77": 100}}  # every token is 77
    unit = client.completions.create(model=stack.model_name, prompt="stop strings", max_tokens=1, temperature=0,
                                     **forced).choices[0].text
    assert unit, "token 77 has no text of its own"
    for min_tokens, text in ((0, ""), (3, unit * 3)):
        held = client.completions.create(model=stack.model_name, prompt="stop strings", max_tokens=6, temperature=0,
                                         stop=[unit], extra_body={"min_tokens": min_tokens}, **forced)
        choice = held.choices[0]
        assert (choice.text, choice.finish_reason, held.usage.completion_tokens) == (text, "stop", min_tokens + 1)


def post(stack, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"{stack.gateway_url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_tokenize_and_detokenize(stack):
    text = "The quick brown fox"
    tokenized = post(stack, "/tokenize", {"model": stack.model_name, "prompt": text})[1]
    assert tokenized["count"] == len(tokenized["tokens"]) > 0 and tokenized["max_model_len"] > 0
    back = post(stack, "/detokenize", {"model": stack.model_name, "tokens": tokenized["tokens"]})[1]
    assert text in back["prompt"]
    chat = post(stack, "/tokenize", {"model": stack.model_name, "add_generation_prompt": True,
                                     "messages": [{"role": "user", "content": text}]})[1]
    assert chat["count"] > tokenized["count"] and tokenized["token_strs"] is None is chat["token_strs"]
    for shape in ({"prompt": text}, {"messages": [{"role": "user", "content": text}]}):  # vLLM's return_token_strs
        pieces = post(stack, "/tokenize", {"model": stack.model_name, "return_token_strs": True, **shape})[1]
        assert len(pieces["token_strs"]) == pieces["count"] and all(isinstance(p, str) for p in pieces["token_strs"])
        assert "The quick brown fox" in "".join(pieces["token_strs"]).replace("\u0120", " ")  # (byte-level: "Ġ" a space)
    status, bad = post(stack, "/detokenize", {"model": stack.model_name, "tokens": [10**9]})
    assert status == 400 and bad["error"]["param"] == "tokens"
    status, bad = post(stack, "/tokenize", {"model": stack.model_name, "prompt": "x", "add_special_tokens": "maybe"})
    assert status == 400 and bad["error"]["param"] == "add_special_tokens"  # named, as the OpenAI endpoints do
    assert post(stack, "/tokenize", {"model": "other", "prompt": "x"})[0] == 404


def test_vllms_text_fields_are_honoured(client, stack):
    """``skip_special_tokens``, ``include_stop_str_in_output`` and ``truncate_prompt_tokens`` as
    vLLM's: special tokens shown where asked, the stop string kept, the prompt's last tokens served."""
    bos = {"logit_bias": {"1": 100}}  # (the tiny tokenizer's <bos>: a special token, every step)
    shown = client.completions.create(model=stack.model_name, prompt="special", max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True, "skip_special_tokens": False, **bos})
    hidden = client.completions.create(model=stack.model_name, prompt="special", max_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True, **bos})
    assert (shown.choices[0].text, hidden.choices[0].text) == ("<bos>" * 3, "")
    # The token that ends the answer (EOS; one of stop_token_ids) is not its text unless asked for (vLLM's).
    eos = {"logit_bias": {"1": 50, "2": 100}, "min_tokens": 2}  # <bos> twice, then <eos>
    for extra, text in (({}, "<bos><bos>"), ({"include_stop_str_in_output": True}, "<bos><bos><eos>")):
        ended = client.completions.create(model=stack.model_name, prompt="special", max_tokens=6, temperature=0,
                                          extra_body={"skip_special_tokens": False, **eos, **extra}).choices[0]
        assert (ended.text, ended.finish_reason, ended.stop_reason) == (text, "stop", None)
        stopped = client.completions.create(model=stack.model_name, prompt="special", max_tokens=6, temperature=0,
                                            extra_body={"skip_special_tokens": False, "stop_token_ids": [1],
                                                        **bos, **extra}).choices[0]
        assert (stopped.text, stopped.stop_reason) == (text.count("<eos>") * "<bos>", 1)
    greedy = {"model": stack.model_name, "prompt": "stop strings", "max_tokens": 12, "temperature": 0}
    text = client.completions.create(**greedy, extra_body={"ignore_eos": True}).choices[0].text
    stop = text[3:6]
    cut = text[:text.index(stop)]
    kept = client.completions.create(**greedy, stop=[stop],
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == cut + stop and kept.choices[0].finish_reason == "stop"
    assert client.completions.create(**greedy, stop=[stop], extra_body={"ignore_eos": True}).choices[0].text == cut
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    alone = client.completions.create(model=stack.model_name, prompt=prompt[-3:], max_tokens=4, temperature=0)
    cut_prompt = client.completions.create(model=stack.model_name, prompt=prompt, max_tokens=4, temperature=0,
                                           extra_body={"truncate_prompt_tokens": 3})
    assert cut_prompt.usage.prompt_tokens == 3 and cut_prompt.choices[0].text == alone.choices[0].text
    # A prompt longer than the context is what it is for: token ids, and text past the size bound.
    context = client.models.retrieve(stack.model_name).model_extra["max_model_len"]
    for long_prompt in ([5, 6, 7] * context, "many words " * context * 4):
        cut = client.completions.create(model=stack.model_name, prompt=long_prompt, max_tokens=4,
                                        extra_body={"truncate_prompt_tokens": -1})
        assert cut.usage.prompt_tokens == context - 4
    chat = client.chat.completions.create(model=stack.model_name, messages=[{"role": "user", "content": "long " * 20}],
                                          max_tokens=2, extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5


@pytest.mark.parametrize("stream", [False, True])
def test_the_client_names_its_request(client, stack, stream):
    """``X-Request-Id`` (else vLLM's ``request_id``) names the answer, as in vLLM, and comes back as a
    header; two clients naming their requests alike do not meet on the workers."""
    raw = client.with_raw_response
    made = raw.completions.create(model=stack.model_name, prompt="named", max_tokens=2, stream=stream,
                                  extra_headers={"X-Request-Id": "trace-7"})
    ids = {c.id for c in made.parse()} if stream else {made.parse().id}
    assert ids == {"cmpl-trace-7"} and made.headers["x-request-id"] == "trace-7"
    chat = raw.chat.completions.create(model=stack.model_name, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, stream=stream, extra_body={"request_id": "mine"})
    ids = {c.id for c in chat.parse()} if stream else {chat.parse().id}
    assert ids == {"chatcmpl-mine"} and "x-request-id" not in chat.headers
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(4) as pool:  # the same name at once: each its own answer
        alike = list(pool.map(lambda i: client.completions.create(
            model=stack.model_name, prompt=f"same name {i}", max_tokens=6, temperature=0,
            extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": "same"}), range(4)))
    assert all(a.id == "cmpl-same" and a.usage.completion_tokens == 6 for a in alike)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=stack.model_name, prompt="x", max_tokens=1,
                                  extra_headers={"X-Request-Id": "has space"})
    assert info.value.body["param"] == "X-Request-Id"


def test_best_of_answers_the_likeliest_of_its_candidates(client, stack):
    """best_of=4, n=2: the 4 candidates are the n=4 choices of the same seed (choice i seeded seed + i),
    the two answered those of the highest cumulative logprob, all four counted in the usage."""
    sampled = {"model": stack.model_name, "prompt": "best of", "max_tokens": 5, "temperature": 1.0, "seed": 3,
               "extra_body": {"ignore_eos": True}}
    every = client.completions.create(**sampled, n=4, logprobs=0)
    ranked = sorted(every.choices, key=lambda c: (-sum(c.logprobs.token_logprobs), c.index))
    best = client.completions.create(**sampled, n=2, best_of=4)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]] and [c.index for c in best.choices] == [0, 1]
    assert all(c.logprobs is None for c in best.choices) and best.usage.completion_tokens == 20
    shown = client.completions.create(**sampled, n=2, best_of=4, logprobs=1)
    assert [c.text for c in shown.choices] == [c.text for c in ranked[:2]] and all(c.logprobs for c in shown.choices)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_stream_sends_a_chunk_a_token_even_before_its_text_completes(client, stack, kind):
    """As vLLM: a token that completes no character yet (here a lead byte, every step: the text is
    only whole at the end) still sends its chunk, so tools that time chunks time tokens (a frame's:
    the first one may carry two, the prefill worker's and the decode worker's first)."""
    lead = post(stack, "/tokenize", {"model": stack.model_name, "prompt": "é", "add_special_tokens": False})[1]["tokens"][0]
    ask = {"model": stack.model_name, "max_tokens": 4, "stream": True, "logit_bias": {str(lead): 100},
           "extra_body": {"ignore_eos": True}}
    if kind == "chat":
        chunks = [c.choices[0] for c in client.chat.completions.create(
            messages=[{"role": "user", "content": "bytes"}], **ask) if c.choices]
        texts = [c.delta.content for c in chunks if c.delta.role is None]
    else:
        texts = [c.choices[0].text for c in client.completions.create(prompt="bytes", **ask)]
    assert len(texts) >= 3 and set(texts[:-1]) == {""} and texts[-1]  # the bytes' text comes with the last
