"""A worker whose KV port stopped accepting reports itself unhealthy (/health 503).

No prefill worker can reach its KV port any more, so it must leave the routing of whoever reads its
health (compose, the launcher, operators) instead of answering 200 for good.  A unit test of the
health handler over a real KV listener whose accept loop ended (its accept reported EBADF: the
listening socket itself broken).
"""
from __future__ import annotations

import asyncio
import errno
import json
import types

from common.engine.kv.kv_cache import KVCache, KVLayout
from worker.admin_routes import AdminHandlers
from worker.lifecycle import Worker
from kvtransfer import KVReceiver, KVTransferConfig

LAYOUT = KVLayout(model_id="tiny", dtype="float32", block_size=4, num_layers=1, num_kv_heads=1, head_dim=4)


def bare_worker() -> Worker:
    """A started worker's state as far as /health reads it: an engine thread that has not failed."""
    worker = Worker.__new__(Worker)
    worker.engine_thread = types.SimpleNamespace(fatal_error=None)
    worker.role, worker.state, worker.instance = "decode", "active", "run-1"
    return worker


async def health(worker: Worker) -> tuple[int, dict]:
    response = await AdminHandlers(worker).health(None)
    return response.status, json.loads(response.body)


async def test_health_fails_once_the_kv_accept_loop_has_ended(monkeypatch):
    worker = bare_worker()
    assert (await health(worker))[0] == 200
    loop = asyncio.get_running_loop()

    async def broken_accept(sock):
        raise OSError(errno.EBADF, "the listening socket is gone")

    monkeypatch.setattr(loop, "sock_accept", broken_accept)
    receiver = KVReceiver(KVCache(LAYOUT, 4), KVTransferConfig(transport="tcp"))
    await receiver.start()
    try:
        listener_task = receiver._listener._listener._task
        await asyncio.wait_for(asyncio.gather(listener_task, return_exceptions=True), 60)
        code, body = await health(worker)
        assert code == 503 and body["status"] == "kv listener down", body
    finally:
        monkeypatch.undo()
        await receiver.close()
    assert (await health(worker))[0] == 200, "a receiver closed on purpose is not a failure"
