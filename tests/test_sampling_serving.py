"""Sampling through the served system: real gateway, prefill and decode workers, real Redis, the
official openai client.  Hostile sampling values must not break anything, and sampled outputs
(seeded) must equal the offline engine's, whichever workers computed them."""
from __future__ import annotations

import openai
import pytest

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from tests.cluster import running_cluster

API_KEY = "test-key"
WORKER_ARGS = ["--num-blocks", "256", "--block-size", "4", "--max-num-batched-tokens", "32"]
PROMPT = "The quick brown fox jumps over the lazy dog, and then"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def stack(served_checkpoint, redis_url, tmp_path_factory):
    # --skip-prefill-below 1: every prompt goes through the prefill worker, which samples the first
    # token; the decode worker samples the rest.
    with running_cluster(served_checkpoint, tmp_path_factory.mktemp("logs"), redis_url, prefill=1, decode=1,
                         worker_args=WORKER_ARGS,
                         gateway_args=["--api-key", API_KEY, "--skip-prefill-below", "1"]) as c:
        yield c


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
