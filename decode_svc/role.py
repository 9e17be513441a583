"""The decode role module: ``POST /generate`` (reserve, remote prefill, continuous-batched decode)."""
from __future__ import annotations

from worker.roles import RoleModule
from decode_svc.generate import handle_generate


def install(worker, app) -> None:
    app.router.add_post("/generate", lambda request: handle_generate(worker, request))


DECODE = RoleModule("decode", install)
