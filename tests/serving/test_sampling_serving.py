"""Sampling through the served system: real gateway, prefill and decode workers, real Redis, the
official openai client.  Hostile sampling values must not break anything, and sampled outputs
(seeded) must equal the offline engine's, whichever workers computed them."""
from __future__ import annotations

from types import SimpleNamespace

import openai
import pytest

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from tests.support.cluster import extra_gateway

API_KEY = "sk-test-key-0123456789"  # the gateway refuses keys under 16 characters
PROMPT = "Sampling through the shared stack: the quick brown fox jumps over the lazy dog, and then"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def stack(small_stack):
    """The session's small stack (its decode worker speculates: the sampled tokens must not change)
    behind a gateway of this module's own: an API key, and --skip-prefill-below 1, so every prompt
    goes through the prefill worker, which samples the first token; the decode worker the rest."""
    with extra_gateway(small_stack, "sampling", ["--api-key", API_KEY, "--skip-prefill-below", "1"]) as proc:
        yield SimpleNamespace(gateway_url=proc.url, model_name=small_stack.model_name, stats=small_stack.stats)


@pytest.fixture(scope="module")
def offline(served_checkpoint):
    """The offline engine on the same checkpoint: ``run(prompt, **params) -> token ids``."""
    engine = Engine(EngineConfig(model=str(served_checkpoint), num_blocks=128, block_size=4))

    def run(prompt: str, **params) -> str:
        ids = engine.tokenizer(prompt).input_ids
        result = engine.generate([ids], {"max_tokens": MAX_TOKENS, "ignore_eos": True, **params})[0]
        return result.text

    return run


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def complete(stack, **params) -> str:
    extra = {"ignore_eos": True, **params.pop("extra_body", {})}
    response = client(stack).completions.create(model=stack.model_name, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                extra_body=extra, **params)
    assert response.choices[0].finish_reason == "length"
    return response.choices[0].text


def test_hostile_sampling_values_leave_the_stack_serving(stack, offline):
    # A temperature this small once made the sampler divide into inf/NaN and killed the decode
    # worker's engine thread; below 1e-5 it means greedy.
    assert complete(stack, temperature=1e-40) == offline(PROMPT, temperature=0)
    # A top_k beyond any vocabulary once failed as a 500 while encoding the internal message; it is
    # clamped to the vocabulary, i.e. the same as no top-k.
    assert complete(stack, temperature=1.0, seed=5, extra_body={"top_k": 2**70}) == offline(PROMPT, seed=5)
    # And the deployment still serves an ordinary request.
    assert complete(stack, temperature=0) == offline(PROMPT, temperature=0)


@pytest.mark.parametrize("field, value", [
    ("temperature", 2.5), ("temperature", -1), ("top_p", 0), ("top_p", 1.01), ("top_k", -2), ("seed", 2**64),
    ("max_tokens", 0), ("logprobs", 21), ("stop", ["x"] * 17),
])
def test_out_of_range_sampling_fields_get_a_400_naming_them(stack, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        client(stack).completions.create(model=stack.model_name, prompt=PROMPT, extra_body={field: value})
    assert info.value.body["param"] == field, info.value.body


@pytest.mark.parametrize("params", [
    {"temperature": 1.0, "seed": 21},
    {"temperature": 0.8, "top_p": 0.9, "seed": 22, "extra_body": {"top_k": 40, "min_p": 0.02}},
    {"temperature": 1.0, "seed": 23, "frequency_penalty": 0.8, "presence_penalty": 0.4,
     "extra_body": {"repetition_penalty": 1.2}},
])
def test_seeded_sampling_through_prefill_and_decode_equals_the_offline_engine(stack, offline, params):
    # The prefill worker samples the first token and the decode worker the rest: both draw from
    # (seed, position) only, so the text equals a single offline engine's.
    before_p = stack.stats("p0")["prefill_computed_tokens"]
    before_d = stack.stats("d0")
    text = complete(stack, **params)
    assert stack.stats("p0")["prefill_computed_tokens"] > before_p
    after_d = stack.stats("d0")
    assert after_d["remote_prefill_fallbacks"] == before_d["remote_prefill_fallbacks"]
    assert after_d["kv_received_bytes"] > before_d["kv_received_bytes"]
    flat = {k: v for k, v in params.items() if k != "extra_body"} | params.get("extra_body", {})
    assert text == offline(PROMPT, **flat)
    assert text == complete(stack, **params)  # and again: reproducible


def test_penalties_change_the_answer(stack, offline):
    greedy = complete(stack, temperature=0)
    penalized = complete(stack, temperature=0, frequency_penalty=2.0, extra_body={"repetition_penalty": 3.0})
    assert penalized == offline(PROMPT, temperature=0, frequency_penalty=2.0, repetition_penalty=3.0)
    assert penalized != greedy
