"""Other workers of this model, by worker id, as the (signature-checked) registry lists them.

A worker never takes a peer's address from a request: the request names the peer (a prefill
worker id in /generate, the calling decode worker's id in /prefill) and the address comes from
that peer's own signed registry entry.  So a caller cannot point a worker at an arbitrary host
(SSRF), nor have prompts, KV or tokens sent anywhere but to a registered worker.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from common.cluster.redis_util import UNAVAILABLE_ERRORS
from common.cluster.registry import WorkerInfo, WorkerRegistry

log = logging.getLogger(__name__)


class PeerDirectory:
    """Looks peers up in the registry, caching each verified entry for ``max_age_s``.

    Redis unreachable: the last verified entry of that peer is used (serving goes on, as the
    gateway's routing does) until the entry expires (``WorkerRegistry.expired``, the rule every
    reader applies) -- then the peer counts as absent, as it would in Redis: the decode worker
    computes the prompt itself rather than send it to whoever holds that address by now.  A peer
    never seen, absent, expired or failing verification is None.  ``monotonic``: the clock of
    the cache's age (tests pass their own; the expiry is on the registry's clock)."""

    MAX_CACHED = 4096  # peer ids come from authenticated callers; this only bounds a misbehaving one

    def __init__(self, registry: WorkerRegistry, model: str, max_age_s: float = 1.0, *,
                 monotonic: Callable[[], float] = time.monotonic):
        self.registry = registry
        self.model = model
        self.max_age_s = max_age_s
        self.monotonic = monotonic
        self._cache: dict[str, tuple[float, WorkerInfo]] = {}

    async def get(self, worker_id: str) -> WorkerInfo | None:
        now = self.monotonic()
        cached = self._cache.get(worker_id)
        if cached is not None and self.registry.expired(cached[1]):
            self._cache.pop(worker_id, None)
            cached = None
        if cached is not None and now - cached[0] < self.max_age_s:
            return cached[1]
        try:
            info = await self.registry.get(self.model, worker_id)
        except UNAVAILABLE_ERRORS as exc:
            if cached is None:
                log.warning("registry unreachable looking up worker %s (%s); no unexpired entry of it known",
                            worker_id, exc)
                return None
            log.warning("registry unreachable looking up worker %s (%s); using its last known entry", worker_id, exc)
            return cached[1]
        if info is None:
            self._cache.pop(worker_id, None)
            return None
        if len(self._cache) >= self.MAX_CACHED:
            self._cache.clear()
        self._cache[worker_id] = (now, info)
        return info

    def forget(self, worker_id: str) -> None:
        """Drop the cached entry (a call to the peer failed: it may have restarted elsewhere)."""
        self._cache.pop(worker_id, None)
