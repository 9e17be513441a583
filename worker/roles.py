"""Role modules: what a service package plugs into the shared worker process.

The worker process (``worker``) knows nothing about prefill or decode: each service package
registers a ``RoleModule`` that adds its HTTP routes and engine-thread hooks.  A worker process
hosts every role module, so its role can change at run time without a restart; the role only
decides which of them accept new requests (``Worker.accepts``).

    python -m decode_svc  ->  worker.main.main("decode", ..., modules=[PREFILL, DECODE])
                                   Worker.start(): module.install(worker, app) for each module
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from aiohttp import web

    from worker.server import Worker


@dataclass(frozen=True)
class RoleModule:
    """One role's part of a worker.

    ``install(worker, app)`` runs once in ``Worker.start()``, after the engine thread is built and
    before it starts or the HTTP server listens: it adds the role's routes to ``app`` and appends
    its hooks to ``worker.engine_thread.after_step``.
    """

    name: str
    install: Callable[["Worker", "web.Application"], None]
