"""Every worker endpoint but ``/health`` answers only requests signed with the cluster secret for
this worker, once each.

    headers present, well formed, v2, for this worker, fresh, nonce unused?   no -> 401, body never read
    Content-Length within the limit?                                          no -> 413, body never read
    read the body (bounded by the app's client_max_size), signature matches it, nonce still unused?
                                                                              no -> 401
    -> the handler runs; its ``await request.read()`` gets the bytes already read

So a caller without the secret cannot make a worker decode a message, allocate a block, abort a
request or drain it, and a captured request works neither again nor on another worker.  This is
the whole authority of the admin endpoints too: the gateway checks the operator's admin token and
signs the call; the token itself never reaches a worker.  The signature scheme is
``common.cluster.auth``'s.
"""
from __future__ import annotations

import logging
from typing import Callable

from aiohttp import web

from common.cluster.auth import AuthError, RequestVerifier

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health"})  # liveness probes (compose health checks) carry no secret


def cluster_auth_middleware(verifier: RequestVerifier, on_refused: Callable[[str], None] | None = None):
    """An aiohttp middleware enforcing ``verifier`` (``ClusterAuth.request_verifier(worker_id)``)
    on every path but ``OPEN_PATHS``.

    ``on_refused(reason)`` is called once per refused request (a metric); reasons are
    ``AuthError.reason``'s (credentials, version, audience, replay, replay_window) and "too_large"."""
    auth = verifier.auth

    def refuse(reason: str, status: int, message: str) -> web.Response:
        if on_refused is not None:
            on_refused(reason)
        return web.json_response({"error": message}, status=status)

    @web.middleware
    async def check(request: web.Request, handler):
        if not auth.enabled or request.path in OPEN_PATHS:
            return await handler(request)
        try:
            credentials = verifier.check_headers(request.headers)
        except AuthError as exc:
            return refuse(exc.reason, 401, str(exc))
        limit = request.client_max_size
        if request.content_length is not None and request.content_length > limit:
            return refuse("too_large", 413, f"request body of {request.content_length} bytes exceeds "
                                            f"the limit of {limit}")
        try:
            body = await request.read()  # bounded by client_max_size; kept for the handler
        except web.HTTPRequestEntityTooLarge:
            return refuse("too_large", 413, f"request body exceeds the limit of {limit} bytes")
        try:
            verifier.verify(request.method, request.raw_path, credentials, body)
        except AuthError as exc:
            log.debug("refused %s %r from %s: %s", request.method, request.path, request.remote, exc)
            return refuse(exc.reason, 401, str(exc))
        return await handler(request)

    return check
