"""The served stack with KV over UCX: real gateway, prefill and decode processes, the openai client.

The rest of the serving tests use TCP; this one proves the UCX transport inside real workers
(TCP headers plus UCX payloads, per-loop UCX worker, clean process exit): greedy outputs equal
the offline engine's, and the KV really moved (no local fallback).
"""
from __future__ import annotations

import openai
import pytest

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from tests.support.cluster import running_cluster

pytestmark = pytest.mark.slow(seconds=13)  # a long file: scheduled by its length (tests/conftest.py)

API_KEY = "sk-test-key-0123456789"  # the gateway refuses keys under 16 characters
PROMPTS = ["KV cache blocks move from the prefill worker to the decode worker over UCX, and then",
           "Streaming tokens to many concurrent clients is what the decode worker does"]


@pytest.fixture(scope="module")
def stack(served_checkpoint, redis_url, tmp_path_factory):
    with running_cluster(served_checkpoint, tmp_path_factory.mktemp("ucxlogs"), redis_url, prefill=1, decode=1,
                         transport="ucx",
                         worker_args=["--num-blocks", "256", "--block-size", "4", "--max-num-batched-tokens", "16"],
                         gateway_args=["--api-key", API_KEY, "--skip-prefill-below", "1"]) as cluster:
        yield cluster


def test_greedy_completions_over_ucx_equal_the_offline_engine(stack, served_checkpoint):
    engine = Engine(EngineConfig(model=str(served_checkpoint), num_blocks=128, block_size=4))
    client = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key=API_KEY, max_retries=0)
    for prompt in PROMPTS:
        response = client.completions.create(model=stack.model_name, prompt=prompt, temperature=0.0,
                                             max_tokens=8, extra_body={"ignore_eos": True})
        ids = engine.tokenizer(prompt).input_ids
        expected = engine.generate([ids], {"max_tokens": 8, "temperature": 0, "ignore_eos": True})[0]
        assert response.choices[0].text == expected.text
    stats = stack.stats("d0")
    assert stats["remote_prefill_fallbacks"] == 0 and stats["kv_transfer_failures"] == 0, stats
    assert stats["kv_received_bytes"] > 0, stats
