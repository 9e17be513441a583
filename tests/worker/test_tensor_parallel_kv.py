"""KV between pools of different tensor-parallel sizes, through real workers: prefill TP=2 and
TP=1, decode TP=1 and TP=2, every pairing over TCP; over UCX the pairing that splits a rank's
share (prefill TP=2 to decode TP=1: the other pairings' frames are the same over either transport,
and tests/kvtransfer/test_kv_transfer_shards.py moves every pairing over UCX).  Each answer equals the one-rank
engine's greedy output, was prefilled where it was sent (no local fallback), and moved exactly
the bytes the decode worker's ranks own; a repeated prompt hits the decode worker's prefix cache
across the TP change."""
from __future__ import annotations

import asyncio

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from tests.support.cluster import running_cluster
from tests.support.scripted_peer import MAX_TOKENS, Stream, WorkerClient

pytestmark = pytest.mark.slow(seconds=24)  # a long file: scheduled by its length (tests/conftest.py)

BLOCK_SIZE = 4
PAIRS = [("p2", "d1"), ("p1", "d2"), ("p2", "d2"), ("p1", "d1")]  # p<prefill TP>, d<decode TP>


def start_stack(transport, names, checkpoint, redis_url, logs):
    """Prefill workers p2 (TP=2) and p1, decode workers d1 and d2 (TP=2): those in ``names``."""
    with running_cluster(checkpoint, logs, redis_url, prefill=0, decode=0, transport=transport,
                         worker_args=["--num-blocks", "96", "--block-size", str(BLOCK_SIZE), "--no-compile"]) as c:
        for name in names:
            role = "prefill" if name[0] == "p" else "decode"
            c.role_args[role] = ["--tensor-parallel-size", name[1]]
            c.start_worker(name, role)
        assert c.wait_for_workers(prefill=sum(n[0] == "p" for n in names), decode=sum(n[0] == "d" for n in names),
                                  timeout=240)
        yield c


@pytest.fixture(scope="module")
def stack(served_checkpoint, redis_url, tmp_path_factory):
    yield from start_stack("tcp", ["p2", "p1", "d1", "d2"], served_checkpoint, redis_url,
                           tmp_path_factory.mktemp("tp-kv-logs"))


@pytest.fixture(scope="module")
def ucx_stack(served_checkpoint, redis_url, tmp_path_factory):
    yield from start_stack("ucx", ["p2", "d1"], served_checkpoint, redis_url, tmp_path_factory.mktemp("tp-kv-ucx-logs"))


@pytest.fixture(scope="module")
def one_rank(served_checkpoint):
    engine = Engine(EngineConfig(model=str(served_checkpoint), num_blocks=64, block_size=BLOCK_SIZE))
    return lambda prompt: engine.generate([prompt], {"max_tokens": MAX_TOKENS, "temperature": 0,
                                                     "ignore_eos": True})[0].token_ids


async def generate(stack, prefill: str, decode: str, prompt: list[int]):
    """The tokens of a greedy stream on ``decode`` prefilled by ``prefill``, and its first frame."""
    async with WorkerClient(stack, decode) as client:
        stream = Stream(client, prompt, prefill_worker_id=prefill)
        tokens = await stream.tokens()
        return tokens, stream.frames[0]


@pytest.mark.parametrize("prefill,decode", PAIRS)
def test_greedy_output_equals_one_rank_across_tp_sizes(stack, one_rank, prefill, decode):
    check_pairing(stack, one_rank, prefill, decode)


def test_a_split_share_over_ucx_equals_one_rank(ucx_stack, one_rank):
    check_pairing(ucx_stack, one_rank, "p2", "d1")


def check_pairing(stack, one_rank, prefill: str, decode: str) -> None:
    """A greedy stream prefilled on ``prefill`` and decoded on ``decode`` equals the one-rank
    engine's, was prefilled there, and moved exactly what the decode worker's ranks own."""
    prompt = [7 + PAIRS.index((prefill, decode)), *range(20, 33)]  # its own first token: no prefix hit
    tokens, first = asyncio.run(generate(stack, prefill, decode, prompt))
    assert tokens == one_rank(prompt)
    assert first.prefill_worker == prefill and not first.prefill_fallback, "not prefilled where it was sent"
    blocks = -(-len(prompt) // BLOCK_SIZE)
    assert first.kv_transfer_bytes == blocks * stack.stats(decode)["kv_bytes_per_block"], \
        "the KV that moved is not exactly what the decode worker's ranks own"


@pytest.mark.parametrize("prefill,decode", [("p1", "d2"), ("p2", "d1")])
def test_a_repeated_prompt_hits_the_decode_prefix_cache_across_tp_sizes(stack, one_rank, prefill, decode):
    prompt = [90 + (prefill == "p1"), *range(40, 57)]  # its own first token: no hit from another test
    first_tokens, first = asyncio.run(generate(stack, prefill, decode, prompt))
    again_tokens, again = asyncio.run(generate(stack, prefill, decode, prompt))
    assert first_tokens == again_tokens == one_rank(prompt)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 16, "no prefix hit on the decode worker"
    assert again.kv_transfer_bytes < first.kv_transfer_bytes
