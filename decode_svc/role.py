"""The decode role module: ``POST /generate`` (reserve, remote prefill, continuous-batched decode)."""
from __future__ import annotations

from decode_svc.generate import handle_generate
from worker.role_context import RoleContext, RoleModule


def install(context: RoleContext, app) -> None:
    app.router.add_post("/generate", lambda request: handle_generate(context, request))


DECODE = RoleModule("decode", install)
