"""The worker's admin role change answers the role it set, even when another change lands while its
registry entry is written (worker/admin_routes.py over the real ``Worker.set_role``; the heartbeat
is held open so the two calls overlap)."""
from __future__ import annotations

import asyncio
import json
import types

from worker.admin_routes import AdminHandlers
from worker.lifecycle import Worker


class HeldHeartbeat:
    """A heartbeat whose writes wait until ``release``."""

    def __init__(self):
        self.gate = asyncio.Event()
        self.writing = 0

    async def beat(self):
        self.writing += 1
        await self.gate.wait()


def bare_worker() -> Worker:
    worker = Worker.__new__(Worker)
    worker.role, worker.state, worker._drain_task, worker.shutting_down = "decode", "active", None, False
    worker.exports_due, worker.precopies_due, worker.in_flight = set(), set(), {}
    worker.config = types.SimpleNamespace(worker_id="w0")
    worker._heartbeat = HeldHeartbeat()
    return worker


class RoleRequest:
    def __init__(self, role: str):
        self.role = role

    async def json(self):
        return {"role": self.role}


async def test_overlapping_role_changes_each_answer_their_own_role():
    worker = bare_worker()
    handlers = AdminHandlers(worker)
    calls = [asyncio.create_task(handlers.role(RoleRequest(role))) for role in ("prefill", "both")]
    while worker._heartbeat.writing < 2:  # both have set their role; neither has answered
        await asyncio.sleep(0)
    worker._heartbeat.gate.set()
    answers = [json.loads((await call).body) for call in calls]
    assert [a["role"] for a in answers] == ["prefill", "both"] and worker.role == "both"
    assert {a["worker_id"] for a in answers} == {"w0"}


async def test_a_worker_draining_to_exit_keeps_its_role_and_its_drain():
    """SIGTERM's drain, then a role change (``pdctl set-role``, the way back from an operator's
    drain): it cancelled the drain, so the shutdown went on at once and cut every stream."""
    worker = bare_worker()
    worker.shutting_down, worker.state = True, "draining"
    worker._drain_task = asyncio.ensure_future(asyncio.sleep(3600))
    worker._heartbeat.gate.set()  # (a write would not wait)
    try:
        answer = await AdminHandlers(worker).role(RoleRequest("prefill"))
        assert answer.status == 409 and "shutting down" in json.loads(answer.body)["error"]
        assert (worker.role, worker.state, worker._drain_task.cancelled(), worker._heartbeat.writing) == (
            "decode", "draining", False, 0)
    finally:
        worker._drain_task.cancel()
