"""Fixtures for the KV-transfer suite: the three transports and connected sender/receiver pairs."""
from __future__ import annotations

import contextlib

import pytest

from common.engine.kv_cache import KVCache, KVLayout
from kvt_support import LAYOUT, NUM_BLOCKS, TRANSPORTS, random_cache
from kvtransfer import KVReceiver, KVSender, KVTransferConfig


@pytest.fixture(params=TRANSPORTS)
def transport(request) -> str:
    return request.param


@pytest.fixture
def make_pair(transport):
    """``async with make_pair(**config) as (sender, receiver)``: src cache seeded, dst zeroed."""

    @contextlib.asynccontextmanager
    async def pair(sender_layout: KVLayout = LAYOUT, **config):
        cfg = KVTransferConfig(transport=transport, **config)
        receiver = KVReceiver(KVCache(LAYOUT, NUM_BLOCKS), cfg)
        await receiver.start()
        sender = KVSender(random_cache(1, sender_layout), cfg)
        try:
            yield sender, receiver
        finally:
            await sender.close()
            await receiver.close()

    return pair
