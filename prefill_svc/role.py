"""The prefill role module: ``POST /prefill`` and the engine-thread hook that ships KV chunk by chunk."""
from __future__ import annotations

from prefill_svc.prefill import handle_prefill
from prefill_svc.shipping import Shipper
from worker.role_context import RoleContext, RoleModule


def install(context: RoleContext, app) -> None:
    shipper = Shipper(context)
    context.on_kv_written.append(shipper.on_kv_written)
    context.engine.after_step.append(shipper.after_step)
    app.router.add_post("/prefill", lambda request: handle_prefill(context, shipper, request))


PREFILL = RoleModule("prefill", install)
