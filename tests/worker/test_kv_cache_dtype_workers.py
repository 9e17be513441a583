"""``--kv-cache-dtype`` through real workers: a prefill worker and a decode worker that both keep a
bf16 KV cache under the fp32 model move it over TCP, and the greedy answer equals the offline
engine's with the same cache, prefilled where it was sent; a prefill worker with the model's fp32
cache is refused at the KV handshake by the bf16 decode worker (the layout names the dtype), which
then computes the prompt itself: the same answer, counted as a fallback."""
from __future__ import annotations

import asyncio

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from tests.support.cluster import running_cluster
from tests.support.scripted_peer import MAX_TOKENS, Stream, WorkerClient

pytestmark = pytest.mark.slow(seconds=12)  # a long file: scheduled by its length (tests/conftest.py)

BLOCK_SIZE = 4
# worker -> its KV cache dtype: pb and db bf16, pf the model's (fp32)
WORKERS = {"pb": ("prefill", "bfloat16"), "pf": ("prefill", "auto"), "db": ("decode", "bfloat16")}


@pytest.fixture(scope="module")
def stack(served_checkpoint, redis_url, tmp_path_factory):
    with running_cluster(served_checkpoint, tmp_path_factory.mktemp("kv-dtype-logs"), redis_url, prefill=0, decode=0,
                         worker_args=["--num-blocks", "96", "--block-size", str(BLOCK_SIZE), "--no-compile"]) as c:
        for name, (role, kv_cache_dtype) in WORKERS.items():
            c.role_args[role] = ["--kv-cache-dtype", kv_cache_dtype]
            c.start_worker(name, role)
        assert c.wait_for_workers(prefill=2, decode=1, timeout=240)
        yield c


@pytest.fixture(scope="module")
def offline(served_checkpoint):
    """Greedy tokens of the offline engine with a bf16 KV cache."""
    engine = Engine(EngineConfig(model=str(served_checkpoint), kv_cache_dtype="bfloat16", num_blocks=64,
                                 block_size=BLOCK_SIZE), load_tokenizer=False)
    return lambda prompt: engine.generate([prompt], {"max_tokens": MAX_TOKENS, "temperature": 0,
                                                     "ignore_eos": True})[0].token_ids


async def generate(stack, prefill: str, prompt: list[int]):
    async with WorkerClient(stack, "db") as client:
        stream = Stream(client, prompt, prefill_worker_id=prefill)
        tokens = await stream.tokens()
        return tokens, stream.frames[0]


def test_bf16_caches_on_both_sides_move_and_answer_as_the_engine(stack, offline):
    prompt = [5, *range(40, 55)]
    before = stack.stats("db")["remote_prefill_fallbacks"]
    tokens, first = asyncio.run(generate(stack, "pb", prompt))
    assert tokens == offline(prompt)
    assert first.prefill_worker == "pb" and not first.prefill_fallback, "not prefilled where it was sent"
    assert stack.stats("db")["remote_prefill_fallbacks"] == before


def test_a_prefill_worker_with_another_cache_dtype_is_refused_and_the_decode_worker_computes(stack, offline):
    prompt = [6, *range(60, 75)]
    before = stack.stats("db")["remote_prefill_fallbacks"]
    tokens, first = asyncio.run(generate(stack, "pf", prompt))
    assert tokens == offline(prompt)
    assert first.prefill_fallback, "a KV cache of another dtype was taken"
    assert stack.stats("db")["remote_prefill_fallbacks"] == before + 1
    log = stack.procs["db"].log_path.read_text(errors="replace")
    assert "KV layout mismatch" in log and "dtype: 'bfloat16' != 'float32'" in log
