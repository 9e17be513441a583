"""vLLM's probe and information routes, for the load balancers, autoscalers and clients written for
it (like ``/health``, they answer without an API key):

    GET|POST /ping   -> /health's status code, no body (SageMaker's probe, as vLLM serves it)
    GET  /version    -> {"version": this package's}
    GET  /load       -> {"server_load": requests in flight on this gateway}
"""
from __future__ import annotations

from importlib import metadata
from typing import Awaitable, Callable

from aiohttp import web

from gateway.admission import InflightBound


def _version() -> str:
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:  # (run from a checkout that was not installed)
        return "unknown"


def add_probe_routes(app: web.Application, health: Callable[[web.Request], Awaitable[web.Response]],
                     admission: InflightBound) -> None:
    """Add the routes above; ``health``: the gateway's ``/health`` handler; ``admission``: what
    counts the generation requests in flight."""
    version = _version()

    async def ping(request: web.Request) -> web.Response:
        return web.Response(status=(await health(request)).status)

    async def show_version(_request: web.Request) -> web.Response:
        return web.json_response({"version": version})

    async def load(_request: web.Request) -> web.Response:
        return web.json_response({"server_load": admission.inflight})

    app.router.add_get("/ping", ping)
    app.router.add_post("/ping", ping)
    app.router.add_get("/version", show_version)
    app.router.add_get("/load", load)
