"""Every worker endpoint but ``/health`` answers only requests signed with the cluster secret for
this run of this worker, once each.

    headers present, well formed, v3, for this worker and run, fresh, signature right, nonce unused?
                                                        no -> 401, nothing of the body read
    the signed body length within the limit?           no -> 413, nothing of the body read
    Content-Length present and equal to the signed length?
                                                        no -> 411 / 401, nothing of the body read
    read exactly that many bytes; their SHA-256 the signed one?
                                                        no -> 401 (the nonce stays usable)
    -> the handler runs; its ``await request.read()`` gets the bytes already read

So a caller without the secret cannot make a worker read a body, decode a message, allocate a
block, abort a request or drain it, and a captured request works neither again nor on another
worker (nor on a later run of the same one).  This is the whole authority of the admin endpoints
too: the gateway checks the operator's admin token and signs the call; the token itself never
reaches a worker.  The signature scheme is ``common.cluster.auth``'s.
"""
from __future__ import annotations

import logging
from typing import Callable

from aiohttp import web

from common.cluster.auth import AuthError, RequestVerifier

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health"})  # liveness probes (compose health checks) carry no secret


def cluster_auth_middleware(verifier: RequestVerifier, on_refused: Callable[[str], None] | None = None):
    """An aiohttp middleware enforcing ``verifier`` (``ClusterAuth.request_verifier(worker_id,
    instance)``) on every path but ``OPEN_PATHS``.

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
            credentials = verifier.verify_headers(request.method, request.raw_path, request.headers)
        except AuthError as exc:
            log.debug("refused %s %r from %s: %s", request.method, request.path, request.remote, exc)
            return refuse(exc.reason, 401, str(exc))
        served = False
        try:
            signed, limit = credentials.body_length, request.client_max_size
            if signed > limit:
                return refuse("too_large", 413, f"request body of {signed} bytes exceeds the limit of {limit}")
            sent = request.content_length
            if sent is None and request.body_exists:
                return refuse("credentials", 411, "a signed request's body must come with a Content-Length")
            if (sent or 0) != signed:
                return refuse("credentials", 401, f"the body is not the one the cluster credentials were signed for "
                                                  f"(Content-Length {sent or 0}, signed for {signed} bytes)")
            body = await request.read()  # exactly Content-Length bytes; kept for the handler
            try:
                verifier.verify_body(credentials, body)
            except AuthError as exc:
                log.debug("refused %s %r from %s: %s", request.method, request.path, request.remote, exc)
                return refuse(exc.reason, 401, str(exc))
            served = True
        finally:
            if not served:  # refused, the body never arrived, or the caller left: nothing was done
                verifier.release(credentials)
        return await handler(request)

    return check
