"""Helpers shared by the KV-transfer tests and their subprocess peer (tiny layout, seeded caches)."""
from __future__ import annotations

import torch

from common.cluster.auth import ClusterAuth
from common.engine.kv.kv_cache import KVCache, KVLayout
from common.engine.kv.kv_shards import KVShards

# 2 layers x K/V x 4 tokens x 2 heads x 8 dims x fp32 = 1 KiB per block.
LAYOUT = KVLayout(model_id="tiny", dtype="float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
NUM_BLOCKS = 32
# 2 layers x K/V x 16 tokens x 8 heads x 128 dims x fp32 = 256 KiB per block: a payload of all of them
# (256 MiB) takes a while to land, even on loopback.
BIG_LAYOUT = KVLayout(model_id="tiny", dtype="float32", block_size=16, num_layers=2, num_kv_heads=8, head_dim=128)
BIG_BLOCKS = 1024
SHARDS = KVShards.single(KVCache(LAYOUT, 1))  # what a one-rank worker of LAYOUT announces in a handshake
TRANSPORTS = ["inproc", "tcp", "ucx"]
# Every sender and receiver in the suite proves this secret, as workers prove the cluster secret.
AUTH = ClusterAuth("kvtransfer-test-cluster-secret")


def random_cache(seed: int, layout: KVLayout = LAYOUT, num_blocks: int = NUM_BLOCKS) -> KVCache:
    cache = KVCache(layout, num_blocks)
    gen = torch.Generator().manual_seed(seed)
    cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=gen).to(cache.buffer.dtype))
    return cache


async def wait_until(condition, timeout: float = 60.0, what: str = "condition") -> None:
    """Poll ``condition()`` on the event loop until it holds (for states that have no event)."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout}s")
        await asyncio.sleep(0.005)
