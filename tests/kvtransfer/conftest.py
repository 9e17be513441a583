"""Fixtures for the KV-transfer suite: the three transports, both event loops, sender/receiver pairs.

Every async test here runs twice, under the stdlib asyncio loop and under uvloop (what the
workers use): the transports rely on loop callbacks (add_reader/add_writer) whose behaviour on a
closed socket differs between the two.
"""
from __future__ import annotations

import asyncio
import contextlib

import pytest
import uvloop

from common.engine.kv.kv_cache import KVCache, KVLayout
from kvt_support import AUTH, LAYOUT, NUM_BLOCKS, TRANSPORTS, random_cache
from kvtransfer import KVReceiver, KVSender, KVTransferConfig


def pytest_asyncio_loop_factories(config, item):
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(params=TRANSPORTS)
def transport(request) -> str:
    return request.param


@pytest.fixture
def make_pair(transport):
    """``async with make_pair(**config) as (sender, receiver)``: src cache seeded, dst zeroed."""

    @contextlib.asynccontextmanager
    async def pair(sender_layout: KVLayout | None = None, layout: KVLayout = LAYOUT, **config):
        cfg = KVTransferConfig(transport=transport, **config)
        receiver = KVReceiver(KVCache(layout, NUM_BLOCKS), cfg, auth=AUTH)
        await receiver.start()
        sender = KVSender(random_cache(1, sender_layout or layout), cfg, auth=AUTH)
        try:
            yield sender, receiver
        finally:
            await sender.close()
            await receiver.close()

    return pair
