"""Real processes for integration tests: gateway, prefill and decode workers, against real Redis."""
from __future__ import annotations

import contextlib
import time
import uuid
from pathlib import Path

import redis

from common.cluster.launcher import LocalStack, http_json  # noqa: F401  (re-exported for tests)

ADMIN_TOKEN = "admin-secret"  # what the gateway and the workers of a test cluster accept


@contextlib.contextmanager
def running_cluster(checkpoint: Path, workdir: Path, redis_url: str, *, prefill: int = 2, decode: int = 1,
                    transport: str = "tcp", policy: str = "prefix_aware", worker_args=(), gateway_args=(),
                    role_args: dict[str, list[str]] | None = None):
    """Start a ``LocalStack`` for a test (logs in ``workdir``, short heartbeats, an admin token) under
    its own key prefix; stop it and delete only its keys afterwards."""
    key_prefix = f"pdtest-{uuid.uuid4().hex[:12]}"
    cluster = LocalStack(
        str(checkpoint), redis_url, key_prefix=key_prefix, workdir=workdir, prefill=prefill, decode=decode,
        transport=transport, policy=policy,
        worker_args=["--heartbeat-ttl", "2", "--admin-token", ADMIN_TOKEN, *worker_args], role_args=role_args or {},
        gateway_args=["--admin-token", ADMIN_TOKEN, *gateway_args],
        extra_env={"OMP_NUM_THREADS": "1"},  # several processes share two cores
    )
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        delete_keys(redis_url, key_prefix)


@contextlib.contextmanager
def extra_gateway(stack: LocalStack, name: str, args: list[str], env: dict[str, str] | None = None,
                  timeout: float = 120):
    """Another gateway on ``stack``'s pools, with its own flags and ``PDSERVE_*`` variables; yields
    its ``Proc`` once it routes to a decode worker, and stops it afterwards."""
    saved = dict(stack.extra_env)
    stack.extra_env.update(env or {})
    try:
        proc = stack.start_gateway(name, args)
    finally:
        stack.extra_env.clear()
        stack.extra_env.update(saved)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if http_json(f"{proc.url}/health", timeout=2)["pools"]["decode"]["healthy"]:
                    break
            except (OSError, ValueError, KeyError):
                assert proc.popen.poll() is None, proc.log()
            assert time.monotonic() < deadline, f"gateway {name} not ready:\n{proc.log()}"
            time.sleep(0.2)
        yield proc
    finally:
        proc.popen.terminate()
        proc.popen.wait(15)
        stack.procs.pop(name, None)


def delete_keys(redis_url: str, key_prefix: str) -> None:
    try:
        client = redis.Redis.from_url(redis_url)
        stale = list(client.scan_iter(match=f"{key_prefix}:*", count=1000))
        if stale:
            client.delete(*stale)
        client.close()
    except redis.exceptions.ConnectionError:
        pass  # a test may have taken its private Redis down
