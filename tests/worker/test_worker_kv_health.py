"""A worker whose KV port stopped accepting reports itself unhealthy (/health 503).

No prefill worker can reach its KV port any more, so it must leave the routing of whoever reads its
health (compose, the launcher, operators) instead of answering 200 for good.  Unit tests of the
health handler over a real KV listener whose accept loop ended (its accept reported EBADF: the
listening socket itself broken), and over a real UCX receiver whose UCX TCP listener a flood of
connections closed (UCX's accept failed for want of descriptors: it drops that listener for good).
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import resource
import socket
import types

import pytest

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


@contextlib.contextmanager
def descriptors_capped(headroom: int):
    """This process may open only ``headroom`` more descriptors meanwhile."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + headroom, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_health_fails_once_ucx_has_closed_its_tcp_listener():
    pytest.importorskip("ucxx")
    from kvtransfer.ucx_worker import failed_ucx_listeners

    worker = bare_worker()
    bystander = socket.create_server(("127.0.0.1", 0))  # a listener of this process, not UCX's
    receiver = KVReceiver(KVCache(LAYOUT, 4), KVTransferConfig(transport="ucx", host="127.0.0.1"))
    await receiver.start()
    flood: list[socket.socket] = [bystander]
    try:
        assert (await health(worker))[0] == 200
        ucx = receiver.transport._ucx
        [port] = ucx.tcp_listeners.ports
        # Held at the cap until UCX's accept has failed: its progress thread accepts what this side
        # connects, and whichever side finds no descriptor first varies.  When this side does, one
        # of its sockets gives its descriptor back and connects again, so the next accept is UCX's
        # to fail (before, the cap was lifted first, and UCX accepted the rest at leisure).
        with descriptors_capped(64):
            for _ in range(2000):
                if failed_ucx_listeners():
                    break
                try:
                    flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                except OSError:  # this side is out of descriptors
                    if len(flood) > 1:  # (the bystander stays)
                        flood.pop().close()
                    await asyncio.sleep(0.01)
        code, body = await health(worker)
        assert code == 503 and body["status"] == "ucx listener down", body
    finally:
        for sock in flood:
            sock.close()
        await receiver.close()
    assert (await health(worker))[0] == 200, "a UCX worker closed on purpose is not a failure"
