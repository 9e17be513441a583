"""``pdctl metrics-proxy``: Prometheus service discovery from the registry, and a relay for the
workers' ``/metrics``.

Workers publish no ports and answer internal requests only when they carry the cluster's
signature, which Prometheus cannot make.  So Prometheus asks this proxy:

    GET /targets/workers          HTTP SD: one target per registered worker, labelled worker_id,
                                  role and model; __metrics_path__ = /workers/<id>/metrics
    GET /workers/<id>/metrics     the worker's /metrics, fetched with a signed request
    GET /targets/dcgm             HTTP SD for the DCGM exporters (--dcgm-targets)
    GET /health

The worker list comes from the gateway's ``/admin/pools`` (which lists only verified entries),
cached for a few seconds.

Scrapers authenticate: every endpoint but ``/health`` requires ``Authorization: Bearer <token>``
(``--metrics-token``, ``PDSERVE_METRICS_TOKEN``, or a file), answered 401 otherwise, so the proxy
relays the workers' metrics only to Prometheus, not to whatever else shares its network.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import signal
import time
from urllib.parse import quote, urlsplit

import aiohttp
from aiohttp import web

from common.cluster.auth import ClusterAuth, audience_of
from common.cluster.credentials import bearer_token, credential_bytes, presented
from common.cluster.http_limits import HttpLimits
from common.cluster.http_listener import GuardedSite
from common.cluster.messages import read_response

log = logging.getLogger(__name__)
MAX_METRICS_BYTES = 16 << 20
POOLS_TTL_S = 5.0


class MetricsProxy:
    """See the module docstring.  ``public_address`` is how Prometheus reaches this proxy;
    ``scrape_token`` the bearer token scrapers must present (None: no check, for a proxy that only
    this machine reaches -- ``pdctl metrics-proxy`` refuses that on any other address)."""

    def __init__(self, gateway_url: str, admin_token: str | None, auth: ClusterAuth, public_address: str,
                 dcgm_targets: str = "", timeout_s: float = 5.0, *, scrape_token: str | None):
        self.gateway_url = gateway_url.rstrip("/")
        self.admin_token = admin_token
        self.auth = auth
        # Compared as digests: equal length, constant time, nothing learned from a near miss.
        self._token_digest = hashlib.sha256(scrape_token.encode()).digest() if scrape_token else None
        self.public_address = public_address
        self.dcgm_targets = dcgm_targets
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._pools: tuple[float, list[dict]] = (0.0, [])
        self._session: aiohttp.ClientSession | None = None

    async def workers(self) -> list[dict]:
        fetched_at, workers = self._pools
        if time.monotonic() - fetched_at < POOLS_TTL_S:
            return workers
        headers = {"X-Admin-Token": self.admin_token} if self.admin_token else {}
        async with self._session.get(f"{self.gateway_url}/admin/pools", headers=headers, timeout=self.timeout) as resp:
            if resp.status != 200:
                raise web.HTTPBadGateway(text=f"gateway /admin/pools answered {resp.status}")
            workers = (await resp.json())["workers"]
        self._pools = (time.monotonic(), workers)
        return workers

    async def _targets_workers(self, _request: web.Request) -> web.Response:
        targets = [{"targets": [self.public_address],
                    "labels": {"__metrics_path__": f"/workers/{quote(w['worker_id'], safe='')}/metrics",
                               "instance": w["worker_id"], "worker_id": w["worker_id"], "role": w["role"],
                               "model": w.get("model", "")}}
                   for w in await self.workers()]
        return web.json_response(targets)

    async def _targets_dcgm(self, _request: web.Request) -> web.Response:
        spec = self.dcgm_targets.strip()
        if spec.startswith("workers:"):  # one exporter per host that runs workers
            port = spec.split(":", 1)[1]
            hosts = sorted({urlsplit(w["http_address"]).hostname for w in await self.workers()} - {None})
            addresses = [f"{h}:{port}" for h in hosts]
        else:
            addresses = [a.strip() for a in spec.split(",") if a.strip()]
        return web.json_response([{"targets": addresses, "labels": {"job": "dcgm"}}] if addresses else [])

    async def _worker_metrics(self, request: web.Request) -> web.Response:
        worker_id = request.match_info["worker_id"]
        worker = next((w for w in await self.workers() if w["worker_id"] == worker_id), None)
        if worker is None:
            raise web.HTTPNotFound(text=f"unknown worker {worker_id!r}")
        headers = self.auth.sign_request("GET", "/metrics", audience=audience_of(worker_id, worker["instance"]))
        try:
            async with self._session.get(f"{worker['http_address']}/metrics", headers=headers,
                                         timeout=self.timeout) as resp:
                if resp.status != 200:
                    raise web.HTTPBadGateway(text=f"worker {worker_id} /metrics: HTTP {resp.status}")
                body = await read_response(resp, MAX_METRICS_BYTES)  # whole, or refused above the limit
                return web.Response(body=body, content_type="text/plain", charset="utf-8")
        except ValueError as exc:
            raise web.HTTPBadGateway(text=f"worker {worker_id} /metrics: {exc}") from None
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise web.HTTPBadGateway(text=f"worker {worker_id} did not answer: {exc}") from None

    async def _health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    @web.middleware
    async def _require_token(self, request: web.Request, handler):
        if self._token_digest is not None and request.path != "/health":
            token = credential_bytes(bearer_token(presented(request.headers, "Authorization")))
            if not hmac.compare_digest(hashlib.sha256(token).digest(), self._token_digest):
                raise web.HTTPUnauthorized(text="metrics-proxy: missing or wrong bearer token\n",
                                           headers={"WWW-Authenticate": 'Bearer realm="pdserve-metrics"'})
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._require_token])
        app.router.add_get("/health", self._health)
        app.router.add_get("/targets/workers", self._targets_workers)
        app.router.add_get("/targets/dcgm", self._targets_dcgm)
        app.router.add_get("/workers/{worker_id}/metrics", self._worker_metrics)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app) -> None:
        self._session = aiohttp.ClientSession()

    async def _close(self, _app) -> None:
        await self._session.close()


def serve(proxy: MetricsProxy, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM, with the connection limits of every HTTP port (``GuardedSite``)."""
    print(f"metrics-proxy on http://{host}:{port} (targets for {proxy.public_address})", flush=True)
    asyncio.run(_serve(proxy, host, port))


async def _serve(proxy: MetricsProxy, host: str, port: int) -> None:
    runner = web.AppRunner(proxy.app(), handle_signals=False, access_log=None)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await GuardedSite(runner, host, port, HttpLimits()).start()
        await stop.wait()
    finally:
        await runner.cleanup()
