"""A real gateway in this process: its app on a test server (aiohttp's), started and stopped around
a test, with API key ``KEYS["a"]`` (a second, ``KEYS["b"]``, for a keys file) and an admin token."""
from __future__ import annotations

import contextlib

from aiohttp.test_utils import TestClient, TestServer

from gateway.config import GatewayConfig
from gateway.server import Gateway

KEYS = {"a": "sk-inprocess-a-5c0f9e2b7d41a8c3", "b": "sk-inprocess-b-91d4e7a02f6c3b58"}
ADMIN_TOKEN = "admin-inprocess-3f8a1c6e9b2d7045"


@contextlib.asynccontextmanager
async def gateway(served_checkpoint, redis_url: str, key_prefix: str, **settings):
    """A started gateway and a client of its app."""
    config = GatewayConfig(model=str(served_checkpoint), redis_url=redis_url, key_prefix=key_prefix,
                           api_key=KEYS["a"], admin_token=ADMIN_TOKEN, **settings)
    gw = Gateway(config)
    await gw.start()
    try:
        async with TestClient(TestServer(gw.app())) as client:
            yield gw, client
    finally:
        await gw.stop()
