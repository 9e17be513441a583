"""The prefill role module: ``POST /prefill`` and the engine-thread hook that ships KV chunk by chunk."""
from __future__ import annotations

from worker.roles import RoleModule
from prefill_svc.prefill import handle_prefill
from prefill_svc.shipping import Shipper


def install(worker, app) -> None:
    worker.shipper = Shipper(worker)
    worker.engine.runner.on_kv_written.append(worker.shipper.on_kv_written)
    worker.engine_thread.after_step.append(worker.shipper.after_step)
    app.router.add_post("/prefill", lambda request: handle_prefill(worker, request))


PREFILL = RoleModule("prefill", install)
