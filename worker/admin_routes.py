"""The routes every worker serves, whatever its role (the role modules add /generate and /prefill):

    POST /abort      AbortRequest     -> 200 whether or not the request was here
    GET  /health                      -> 200 while serving, 503 once the engine has failed
    GET  /stats[?check=1]             -> JSON counters (tests and ops); check=1 adds the block
                                         pool's integrity check (pool_ok, pool_error) and the
                                         requests the engine still holds (num_unfinished)
    GET  /metrics                     -> Prometheus text
    GET  /admin/status, POST /admin/drain, POST /admin/role   (the gateway's, signed like every call)
    GET  /admin/steps?since=&limit=   -> the engine's recent steps: time, duration, shape

The admin calls' authority is the cluster signature (for this worker, used once), as for every
route: operators go through the gateway's /admin, which checks their admin token.
"""
from __future__ import annotations

import math
import msgspec
from aiohttp import web

from common.cluster.messages import AbortRequest, decode
from common.engine.engine import Engine
from common.engine.kv.kv_cache import dtype_name
from common.engine.step_log import COLUMNS as STEP_COLUMNS
from kvtransfer.socket_io import failed_listeners
from kvtransfer.ucx_worker import failed_ucx_listeners
from worker.engine_thread import EngineFailed

class ShuttingDown(RuntimeError):
    """A role change refused (409): the worker drains to exit."""


STEPS_PAGE = 4096  # most steps one /admin/steps answer holds (about 400 KB of JSON)


def add_admin_routes(worker, app: web.Application) -> None:
    """Add the routes above for ``worker`` (a ``worker.lifecycle.Worker``, which calls this) to ``app``."""
    handlers = AdminHandlers(worker)
    app.router.add_post("/abort", handlers.abort)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/stats", handlers.stats)
    app.router.add_get("/metrics", handlers.metrics)
    app.router.add_get("/admin/status", handlers.status)
    app.router.add_get("/admin/steps", handlers.steps)
    app.router.add_post("/admin/drain", handlers.drain)
    app.router.add_post("/admin/role", handlers.role)


class AdminHandlers:
    """The handlers of the routes every worker serves, over one ``worker.lifecycle.Worker``."""

    def __init__(self, worker):
        self.worker = worker

    async def abort(self, request: web.Request) -> web.Response:
        try:
            body = decode(await request.read(), AbortRequest)
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response({"aborted": self.worker.in_flight.cancel(body.request_id)})

    async def health(self, _request: web.Request) -> web.Response:
        worker = self.worker
        healthy = worker.engine_thread is not None and worker.engine_thread.fatal_error is None
        status = "ok" if healthy else "engine failed"
        if healthy and failed_listeners():  # the KV port stopped accepting: no prefill reaches this worker
            healthy, status = False, "kv listener down"
        elif healthy and failed_ucx_listeners():  # UCX's own one closed: no new UCX peer reaches it
            healthy, status = False, "ucx listener down"
        return web.json_response({"status": status, "role": worker.role, "state": worker.state,
                                  "instance": worker.instance}, status=200 if healthy else 503)

    async def stats(self, request: web.Request) -> web.Response:
        worker = self.worker
        if request.query.get("check") not in ("1", "true"):
            return web.json_response(worker.stats())

        def collect(engine: Engine) -> dict:  # engine thread: nothing changes under the check
            out = dict(engine.stats(), engine_steps=worker.engine_thread.steps,
                       engine_step_failures=worker.engine_thread.step_failures,
                       num_unfinished=engine.scheduler.num_unfinished)  # requests the engine still holds
            try:
                engine.scheduler.check_integrity()
                out.update(pool_ok=True, pool_error=None)
            except AssertionError as exc:
                out.update(pool_ok=False, pool_error=str(exc))
            return out

        try:
            return web.json_response(worker.stats(await worker.engine_thread.call(collect)))
        except EngineFailed:
            return web.json_response(dict(worker.stats(), pool_ok=None, pool_error="the engine has failed"))

    async def metrics(self, _request: web.Request) -> web.Response:
        self.worker.metrics.observe_engine(self.worker.engine_thread.snapshot)
        if self.worker.engine_thread.core_turns is not None:
            self.worker.metrics.observe_core_turns(self.worker.engine_thread.core_turns)
        return web.Response(body=self.worker.metrics.render(), content_type="text/plain")

    async def status(self, _request: web.Request) -> web.Response:
        return web.Response(body=msgspec.json.encode(self.worker.info()), content_type="application/json")

    async def steps(self, request: web.Request) -> web.Response:
        """The engine's recent steps (``common.engine.step_log``): ``?since=<unix time>`` those that
        ended after it, at most ``?limit=`` (default and most ``STEPS_PAGE``), oldest first."""
        try:
            since = float(request.query.get("since", "-inf"))
            limit = int(request.query.get("limit", STEPS_PAGE))
            if math.isnan(since) or since == math.inf or not 1 <= limit <= STEPS_PAGE:
                raise ValueError
        except ValueError:
            return web.json_response({"error": f"expected ?since=<unix time>&limit=<1-{STEPS_PAGE}>"}, status=400)
        engine = self.worker.engine
        step_log = engine.step_log
        rows = step_log.since(since, limit + 1)
        settings = {"model_id": engine.model_id, "dtype": dtype_name(engine.dtype),
                    "kv_cache_dtype": engine.layout.dtype, "block_size": engine.layout.block_size,
                    "kv_bytes_per_token": engine.layout.block_nbytes / engine.layout.block_size,
                    "max_num_batched_tokens": engine.config.max_num_batched_tokens,
                    "max_num_seqs": engine.config.max_num_seqs, "max_model_len": engine.max_model_len}
        body = {"worker_id": self.worker.config.worker_id, "role": self.worker.role, "engine": settings,
                "columns": list(STEP_COLUMNS), "steps": rows[:limit].tolist(), "more": len(rows) > limit,
                "recorded": step_log.total, "kept": len(step_log)}
        return web.Response(body=msgspec.json.encode(body), content_type="application/json")

    async def drain(self, _request: web.Request) -> web.Response:
        worker = self.worker
        worker.begin_drain()
        return web.json_response({"worker_id": worker.config.worker_id, "role": worker.role, "state": worker.state})

    async def role(self, request: web.Request) -> web.Response:
        worker = self.worker
        try:
            body = await request.json()
            role = body["role"]
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": 'expected a JSON body {"role": "prefill|decode|both"}'}, status=400)
        held = len(worker.in_flight)  # at the change: they finish here in the role they started in
        try:
            await worker.set_role(role)
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        except ShuttingDown as exc:
            return web.json_response({"error": str(exc)}, status=409)
        # The role this call set (another call may have set another since, while this one's entry was written).
        return web.json_response({"worker_id": worker.config.worker_id, "role": role, "state": worker.state,
                                  "inflight": held})
