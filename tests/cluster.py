"""Real processes for integration tests: gateway, prefill and decode workers, against real Redis."""
from __future__ import annotations

from pathlib import Path

from common.launcher import LocalStack, http_json  # noqa: F401  (re-exported for tests)


def Cluster(checkpoint: Path, workdir: Path, redis_url: str, key_prefix: str, *, prefill: int = 2, decode: int = 1,
            transport: str = "tcp", policy: str = "prefix_aware", worker_args=(), gateway_args=()) -> LocalStack:
    """A ``LocalStack`` set up for tests: logs in ``workdir``, short heartbeats, an admin token."""
    return LocalStack(
        str(checkpoint), redis_url, key_prefix=key_prefix, workdir=workdir, prefill=prefill, decode=decode,
        transport=transport, policy=policy,
        worker_args=["--heartbeat-ttl", "2", "--admin-token", "admin-secret", *worker_args],
        gateway_args=["--admin-token", "admin-secret", *gateway_args],
        extra_env={"OMP_NUM_THREADS": "1"},  # several processes share two cores
    )
