"""Real processes for integration tests: gateway, prefill and decode workers, against real Redis."""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import time
import urllib.request
import uuid
from pathlib import Path

import redis

from common.cluster.auth import ClusterAuth
from launcher.local_stack import LocalStack, http_json  # noqa: F401  (re-exported for tests)
from launcher.prewarmed import PrewarmedStarter
from common.cluster.redis_util import connect
from common.cluster.registry import WorkerInfo, WorkerRegistry
from tests.support.waiting import wait_until

# What the gateway of a test cluster accepts on /admin (strong enough to be accepted; given in the
# environment, as secrets should be, not on a command line).
ADMIN_TOKEN = "pdtest-admin-token-5f0c9e1a7b"
# Registry entries of a test cluster's workers outlive their last heartbeat by this much (beats
# every third of it).  Long enough that a live worker's entry never lapses between two beats on
# a loaded machine; a test that needs a dead worker's entry gone waits for it (bounded), and one
# that needs it present holds it (``HeldEntries``), so no test races it either way.
HEARTBEAT_TTL_S = 5.0
# How long a held entry lives without being written again: far longer than any test.
HOLD_TTL_S = 3600.0
# How long ``HeldEntries.capture`` waits for a live worker's entry that is missing for a moment.
CAPTURE_WAIT_S = 60.0

# Every stack of this test process forks its workers and gateways from one server that imported
# torch once (``launcher.prewarmed``): ~3 s of CPU saved per process started, a hundred and more
# per run.  The tests of ``make up`` (tests/launcher) start processes the ordinary way, as it does.
PREWARMED = PrewarmedStarter()
atexit.register(PREWARMED.close)


@contextlib.contextmanager
def running_cluster(checkpoint: Path, workdir: Path, redis_url: str, *, prefill: int = 2, decode: int = 1,
                    transport: str = "tcp", policy: str = "prefix_aware", worker_args=(), gateway_args=(),
                    role_args: dict[str, list[str]] | None = None, extra_env: dict[str, str] | None = None):
    """Start a ``LocalStack`` for a test (logs in ``workdir``, heartbeats of ``HEARTBEAT_TTL_S``, an
    admin token) under its own key prefix, with ``extra_env`` in every process's environment; stop it
    and delete only its keys afterwards."""
    key_prefix = f"pdtest-{uuid.uuid4().hex[:12]}"
    cluster = LocalStack(
        str(checkpoint), redis_url, key_prefix=key_prefix, workdir=workdir, prefill=prefill, decode=decode,
        transport=transport, policy=policy,
        worker_args=["--heartbeat-ttl", str(HEARTBEAT_TTL_S), *worker_args], role_args=role_args or {},
        gateway_args=list(gateway_args), spawner=PREWARMED,
        extra_env={"OMP_NUM_THREADS": "1",  # several processes share two cores
                   "PDSERVE_ADMIN_TOKEN": ADMIN_TOKEN, **(extra_env or {})},
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


@contextlib.contextmanager
def extra_worker(stack: LocalStack, name: str, role: str, timeout: float = 120):
    """Another worker in ``stack``'s pools; yields its ``Proc`` once the gateway routes to it, and
    stops it afterwards (a SIGKILLed one's registry entry lapses on its own)."""
    routed = http_json(f"{stack.gateway_url}/health")["workers"].get(role, 0)
    proc = stack.start_worker(name, role)

    def joined() -> bool:
        assert proc.popen.poll() is None, proc.log()
        return http_json(f"{stack.gateway_url}/health")["workers"].get(role, 0) > routed

    try:
        wait_until(joined, f"the gateway routing to worker {name}", timeout)
        yield proc
    finally:
        proc.popen.terminate()
        proc.popen.wait(30)
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


class HeldEntries:
    """The registry entries of some workers, captured while they run, to be kept in Redis after
    they die -- the condition a test of "the gateway still routes to a dead worker" needs, held
    rather than raced against the entries' TTL::

        held = HeldEntries.capture(stack, ["p0"])   # the workers are alive: their entries exist
        stack.kill("p0")
        with held.kept():                            # written again, living HOLD_TTL_S
            stack.wait_for_workers(...)              # the gateway sees the dead worker: route to it
        # on exit each entry is written once more with the stack's TTL: it lapses as the entry of
        # a worker that stopped heartbeating just now would

    Entries are written the way workers write them (``WorkerRegistry.register``: signed with the
    stack's cluster secret, ``heartbeat_at`` stamped now), so readers take them as live.
    """

    def __init__(self, stack: LocalStack, entries: list[WorkerInfo]):
        self.stack = stack
        self.entries = entries

    @classmethod
    def capture(cls, stack: LocalStack, names: list[str]) -> "HeldEntries":
        async def read() -> list[WorkerInfo]:
            client = connect(stack.redis_url, timeout_s=10)
            registry = WorkerRegistry(client, key_prefix=stack.key_prefix, auth=ClusterAuth(stack.cluster_secret))
            deadline = time.monotonic() + CAPTURE_WAIT_S
            try:
                # A live worker's entry may have lapsed for a moment (a heartbeat late on a loaded
                # machine): it is back at the next heartbeat.
                while True:
                    found = {name: await registry.get(stack.model_name, name) for name in names}
                    missing = [name for name, info in found.items() if info is None]
                    if not missing or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.1)
            finally:
                await client.aclose()
            assert not missing, f"no registry entry for {missing}: capture entries while the workers run"
            return list(found.values())

        return cls(stack, asyncio.run(read()))

    def write(self, ttl_s: float) -> None:
        """Write every entry now, to live ``ttl_s`` seconds."""
        async def put() -> None:
            client = connect(self.stack.redis_url, timeout_s=10)
            try:
                registry = WorkerRegistry(client, key_prefix=self.stack.key_prefix, ttl_s=ttl_s,
                                          auth=ClusterAuth(self.stack.cluster_secret))
                for info in self.entries:
                    await registry.register(info)
            finally:
                await client.aclose()

        asyncio.run(put())

    @contextlib.contextmanager
    def kept(self):
        self.write(HOLD_TTL_S)
        try:
            yield self
        finally:
            self.write(HEARTBEAT_TTL_S)


def gateway_metric(stack, name: str, labels: str = "") -> float:
    """The gateway's value of ``name`` (summed over label sets containing ``labels``)."""
    total = 0.0
    with urllib.request.urlopen(f"{stack.gateway_url}/metrics", timeout=30) as resp:
        for line in resp.read().decode().splitlines():
            if (line.startswith(name + " ") or line.startswith(name + "{")) and labels in line:
                total += float(line.split()[-1])
    return total
