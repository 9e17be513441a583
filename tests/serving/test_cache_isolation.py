"""Prefix-cache isolation end to end: ``cache_salt`` and ``--cache-isolation per-key``, through a
real gateway, a prefill and a decode worker, real Redis and the official openai client.

A request shares cached prompt blocks only with requests of the same salt -- in the workers'
prefix caches and in the gateway's Redis prefix lookup, which must compute the workers' hashes.
Each test sends prompts no other test sends, so the tests pass alone and in any order.
"""
from __future__ import annotations

import random
import time
import urllib.request
import uuid

import openai
import pytest
import redis

from common.cluster.redis_keys import RedisKeys
from common.engine.kv.prefix_hash import MAX_CACHE_SALT_LEN, block_extra_keys, hash_prompt_blocks
from tests.support.checkpoints import VOCAB
from tests.support.cluster import extra_gateway

BLOCK_SIZE = 16  # the small_stack's (tests/conftest.py)
PROMPT_LEN = 6 * BLOCK_SIZE  # above the default --skip-prefill-below (64): a first sight goes to the prefill pool
# A repeat hits every block but the last (the last prompt token is always computed).
REPEAT_HIT = PROMPT_LEN - BLOCK_SIZE
KEYS = {"a": "sk-tenant-a-0123456789", "b": "sk-tenant-b-0123456789"}
DECODE_CACHES_PROMPT = "decode worker caches most of the prompt"  # a routing reason (gateway/routing.py)


@pytest.fixture(scope="module")
def isolated(stack, tmp_path_factory):
    """A second gateway on the same pools with two API keys and ``--cache-isolation per-key``
    (set through its PDSERVE_ variable, as a deployment would)."""
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text("".join(f"{k}\n" for k in KEYS.values()))
    with extra_gateway(stack, "isolated", ["--api-keys-file", str(keys)],
                       env={"PDSERVE_CACHE_ISOLATION": "per-key"}) as proc:
        yield {name: openai.OpenAI(base_url=f"{proc.url}/v1", api_key=key, max_retries=0, timeout=120)
               for name, key in KEYS.items()}


def fresh_prompt() -> list[int]:
    rng = random.Random(uuid.uuid4().int)
    return [rng.randrange(VOCAB) for _ in range(PROMPT_LEN)]


def cached_tokens(client: openai.OpenAI, prompt, salt: str | None = None) -> int:
    extra = {"ignore_eos": True, **({"cache_salt": salt} if salt is not None else {})}
    out = client.completions.create(model=client_model(client), prompt=prompt, max_tokens=2, temperature=0,
                                    extra_body=extra)
    assert out.usage.prompt_tokens == len(prompt)
    return out.usage.prompt_tokens_details.cached_tokens


def client_model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def routed_to_decode_cache(url: str) -> float:
    """How many requests the gateway sent straight to a decode worker that its Redis prefix
    lookup showed holding the prompt."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    label = f'reason="{DECODE_CACHES_PROMPT}"'
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("pdserve_prefill_skipped_total{") and label in line)


def wait_published(stack, worker_id: str, hashes: list[bytes]) -> None:
    """Wait until ``worker_id``'s Redis block set holds ``hashes`` (published after a flush)."""
    client = redis.Redis.from_url(stack.redis_url)
    key = RedisKeys(stack.key_prefix, stack.model_name).blocks(worker_id)
    deadline = time.monotonic() + 60
    try:
        while not all(client.smismember(key, hashes)):
            assert time.monotonic() < deadline, f"{worker_id} never published the prompt's blocks"
            time.sleep(0.1)
    finally:
        client.close()


def test_same_salt_hits_other_salt_or_none_misses(stack, client):
    prompt = fresh_prompt()
    assert cached_tokens(client, prompt, salt="tenant-a") == 0
    # The decode worker now holds the prompt under salt "tenant-a", and says so in Redis under the
    # hashes the gateway computes for that salt (the same function, model id and salt).
    salted = hash_prompt_blocks(prompt, BLOCK_SIZE, block_extra_keys(stack.model_name, "tenant-a"))
    wait_published(stack, "d0", salted)
    before = routed_to_decode_cache(stack.gateway_url)
    assert cached_tokens(client, prompt, salt="tenant-b") == 0
    assert cached_tokens(client, prompt) == 0
    assert routed_to_decode_cache(stack.gateway_url) == before  # the gateway saw no cached prefix for those
    assert cached_tokens(client, prompt, salt="tenant-a") == REPEAT_HIT
    # ... and for the same salt its Redis lookup found the decode worker's blocks.
    assert routed_to_decode_cache(stack.gateway_url) == before + 1


def test_chat_requests_take_a_cache_salt(stack, client):
    words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()
    rng = random.Random(uuid.uuid4().int)
    content = " ".join(rng.choice(words) for _ in range(60))

    def chat_cached(salt: str) -> int:
        out = client.chat.completions.create(model=client_model(client), max_tokens=2, temperature=0,
                                             messages=[{"role": "user", "content": content}],
                                             extra_body={"cache_salt": salt})
        assert out.usage.prompt_tokens > 2 * BLOCK_SIZE
        return out.usage.prompt_tokens_details.cached_tokens

    assert chat_cached("one") == 0
    assert chat_cached("two") == 0
    assert chat_cached("one") > 0


@pytest.mark.parametrize("salt", ["", "x" * (MAX_CACHE_SALT_LEN + 1), 7, ["a"]])
def test_a_bad_cache_salt_is_a_400_naming_it(client, salt):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=client_model(client), prompt="Hello", max_tokens=1,
                                  extra_body={"cache_salt": salt})
    assert caught.value.body["param"] == "cache_salt"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=client_model(client), max_tokens=1,
                                       messages=[{"role": "user", "content": "Hello"}],
                                       extra_body={"cache_salt": salt})
    assert caught.value.body["param"] == "cache_salt"


def test_per_key_isolation_keeps_api_keys_apart(isolated):
    a, b = isolated["a"], isolated["b"]
    prompt = fresh_prompt()
    assert cached_tokens(a, prompt) == 0
    # Another key never learns that key a sent this prompt, even with the same client salt.
    assert cached_tokens(b, prompt) == 0
    assert cached_tokens(a, prompt) == REPEAT_HIT
    # A key's own requests share blocks; its own salts still separate them.
    assert cached_tokens(b, prompt) == REPEAT_HIT
    assert cached_tokens(a, prompt, salt="x") == 0
    assert cached_tokens(b, prompt, salt="x") == 0
    assert cached_tokens(a, prompt, salt="x") == REPEAT_HIT
