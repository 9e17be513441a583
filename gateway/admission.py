"""Bounds on what is in flight at once, overall and per API key: beyond either the answer is a 429 +
Retry-After, not a queue."""
from __future__ import annotations

import contextlib
from typing import Callable

from gateway.openai_errors import OpenAIError
from gateway.tenants import Tenant


class InflightBound:
    """At most ``total`` ``what`` at once, and at most an API key's limit (``Tenant.limit``) of them
    per key; ``on_refused(key_id)`` and ``on_change(+1 | -1)`` tell metrics."""

    def __init__(self, total: int, what: str, on_refused: Callable[[str], None] = lambda key_id: None,
                 on_change: Callable[[int], None] = lambda step: None):
        self.total, self.what = total, what
        self.on_refused, self.on_change = on_refused, on_change
        self.inflight = 0
        self.by_key: dict[str, int] = {}

    @contextlib.asynccontextmanager
    async def __call__(self, tenant: Tenant):
        if self.inflight >= self.total:
            raise OpenAIError(429, f"Too many {self.what} in flight ({self.inflight}); retry shortly",
                              code="rate_limit_exceeded", retry_after=1)
        mine = self.by_key.get(tenant.key_id, 0)
        if tenant.limit is not None and mine >= tenant.limit:
            self.on_refused(tenant.key_id)
            raise OpenAIError(429, f"This API key ({tenant.key_id}) has {mine} {self.what} in flight, its limit; "
                              "retry shortly", code="rate_limit_exceeded", retry_after=1)
        self.inflight += 1
        self.by_key[tenant.key_id] = mine + 1
        self.on_change(1)
        try:
            yield
        finally:
            self.inflight -= 1
            left = self.by_key[tenant.key_id] - 1
            if left:
                self.by_key[tenant.key_id] = left
            else:
                del self.by_key[tenant.key_id]
            self.on_change(-1)
