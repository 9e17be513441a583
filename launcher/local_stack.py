"""Start a whole stack as local processes: Redis (if none answers), workers, the gateway.

``make up`` runs ``python -m launcher``: it starts the stack, then supervises it (a
process that exits is restarted with backoff while the rest keep serving) until Ctrl-C/SIGTERM.
The integration tests and the serving benchmark use ``LocalStack`` to start real processes the same
way (and ``LocalStack.restart`` to bring one back).  Every process of a stack gets the same
cluster secret (``PDSERVE_CLUSTER_SECRET`` from the environment, or a fresh random one), and the
rest of the launcher's environment as well -- but for the admin token (``PDSERVE_ADMIN_TOKEN``,
``PDSERVE_ADMIN_TOKEN_FILE``), which goes to the gateway only: workers take signed admin calls.

Every process is started by ``common.cluster.children``: in a process group of its own, and
SIGKILLed by the kernel if the launcher dies (even by SIGKILL), the private Redis too.  Stopping
drains every process at once, within one bound: the workers' ``--drain-timeout`` plus
``STOP_GRACE_S``.  Ctrl-C (or SIGTERM, SIGHUP) stops the stack; a second one changes nothing; a
third kills every process at once.  Restarts and crash loops: ``launcher.supervisor``.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from common.cluster.ports import free_port  # noqa: F401 (API: the tests take it from here too)
from common.cluster.direct_http import urlopen
from common.cluster.auth import MIN_SECRET_LEN, SECRET_ENV, ClusterAuth, audience_of, generate_secret, secret_problem
from common.cluster.redis_keys import DEFAULT_KEY_PREFIX
from gateway.routing import RoutingConfig
from common.cluster.children import DID_NOT_START, describe_exit, exit_status, signal_group, start_child, stop_all

ROOT = Path(__file__).resolve().parents[1]
# What a process gets beyond its drain to shut down (close listeners, deregister, stop its engine)
# before ``LocalStack.stop`` SIGKILLs it.
STOP_GRACE_S = 10.0
ADMIN_TOKEN_ENVS = ("PDSERVE_ADMIN_TOKEN", "PDSERVE_ADMIN_TOKEN_FILE")  # the gateway's alone


class StartCancelled(Exception):
    """Start-up was abandoned: a stop was asked for before the stack was up."""


def worker_drain_timeout(args: list[str], env: Mapping[str, str]) -> float:
    """How long a worker started with ``args`` and ``env`` drains on SIGTERM: its own
    ``--drain-timeout`` (or ``PDSERVE_DRAIN_TIMEOUT``), read by the worker's own flag parser."""
    from worker.config import build_parser  # imports torch: only where workers are started

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # the worker itself reports what it refuses
            return build_parser("decode", "pdserve worker", env).parse_known_args(args)[0].drain_timeout
    except (SystemExit, ValueError):  # flags the worker refuses too: it exits at once, the default bounds it
        return build_parser("decode", "pdserve worker", {}).get_default("drain_timeout")


def http_json(url: str, method: str = "GET", body: bytes | None = None, headers: dict | None = None,
              timeout: float = 10):
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    with urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def gateway_health(url: str, timeout: float = 2) -> dict:
    """The gateway's /health body, whether it answers 200 (ok, degraded) or 503 (a pool it needs is empty)."""
    try:
        return http_json(f"{url}/health", timeout=timeout)
    except urllib.error.HTTPError as exc:
        if exc.code != 503:
            raise
        return json.loads(exc.read())


@dataclass
class Proc:
    """One process of a stack and how to start it again (same command line, so the same port).

    ``popen`` is None until a start succeeded, and after a start that failed."""

    name: str
    command: list[str]
    url: str
    log_path: Path | None
    drain_timeout_s: float = 0.0  # how long it may take to finish its work after SIGTERM
    popen: subprocess.Popen | None = None
    started_at: float = 0.0  # the stack's clock at the last start (or attempt)
    killed: bool = False  # stopped on purpose (by a test): not an error for wait_for_workers

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path else ""

    def exit_status(self) -> int | str | None:
        """None while it runs; its exit status once it exited; ``DID_NOT_START`` when its last start failed."""
        return DID_NOT_START if self.popen is None else exit_status(self.popen)

    @property
    def alive(self) -> bool:
        return self.exit_status() is None

    def describe_exit(self) -> str:
        status = self.exit_status()
        return "running" if status is None else describe_exit(status)


@dataclass
class LocalStack:
    """``prefill`` prefill workers, ``decode`` decode workers and a gateway on one checkpoint.

    Logs go to ``workdir/<name>.log`` (or the terminal when ``workdir`` is None).  Every process
    gets ``cluster_secret`` (a fresh random one unless given), so workers check every call and
    ``worker_json`` signs its own.  Processes are started by ``common.cluster.children.start_child``
    (their own process group; they die with this process when started from its main thread).
    ``clock`` stamps starts (``Proc.started_at``) and is the default clock of a ``Supervisor``.
    """

    checkpoint: str
    redis_url: str
    key_prefix: str = DEFAULT_KEY_PREFIX
    workdir: Path | None = None
    prefill: int = 1
    decode: int = 1
    both: int = 0
    transport: str = "tcp"
    policy: str = RoutingConfig.policy
    gateway_port: int | None = None
    worker_args: list[str] = field(default_factory=list)
    role_args: dict[str, list[str]] = field(default_factory=dict)  # extra worker args by role (after worker_args)
    gateway_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    cpus: dict[str, list[int]] = field(default_factory=dict)  # CPU affinity by process name (benchmarks)
    cluster_secret: str = field(default_factory=generate_secret, repr=False)
    stop_grace_s: float = STOP_GRACE_S
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    # How a process is started: ``start_child``'s signature and contract (a test suite passes a
    # ``launcher.prewarmed.PrewarmedStarter``, which forks ``python -m`` commands pre-imported).
    spawner: Callable[..., subprocess.Popen] = field(default=start_child, repr=False)
    procs: dict[str, Proc] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        """The served model id (the checkpoint directory's name, as workers and gateway derive it)."""
        return Path(self.checkpoint).name

    @property
    def gateway_url(self) -> str:
        return self.procs["gateway"].url

    def process_env(self, gateway: bool = False) -> dict[str, str]:
        """The environment every process of the stack starts with (the admin token: a gateway's only)."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **self.extra_env)
        env.pop("PDSERVE_CLUSTER_SECRET_FILE", None)  # it would take precedence over the stack's secret
        env[SECRET_ENV] = self.cluster_secret
        # In the environment, not on command lines (``ps`` shows those): the URL may hold a password.
        env["PDSERVE_REDIS_URL"] = env["REDIS_URL"] = self.redis_url
        if not gateway:
            for name in ADMIN_TOKEN_ENVS:
                env.pop(name, None)
        return env

    def spawn(self, name: str, command: list[str], url: str = "", drain_timeout_s: float = 0.0) -> Proc:
        """Start ``command`` as the stack's process ``name`` (in the stack's environment, from the
        repository root); ``drain_timeout_s``: how long it may take to finish after SIGTERM.  The
        process is in ``procs`` even if it could not be started (the error is raised)."""
        log_path = self.workdir / f"{name}.log" if self.workdir else None
        if log_path is not None:
            log_path.write_text("")
        proc = Proc(name, list(command), url, log_path, drain_timeout_s)
        self.procs[name] = proc
        self._launch(proc)
        return proc

    def _spawn(self, name: str, module: str, args: list[str], port: int, drain_timeout_s: float = 0.0) -> Proc:
        """``spawn`` for ``python -m module args`` serving HTTP on ``port``."""
        return self.spawn(name, [sys.executable, "-m", module, *args], f"http://127.0.0.1:{port}", drain_timeout_s)

    def _launch(self, proc: Proc) -> None:
        proc.popen = None
        proc.started_at = self.clock()  # a start that fails is a run of no length
        proc.killed = False
        out = proc.log_path.open("a") if proc.log_path else None
        try:
            env = self.process_env(gateway=proc.command[1:3] == ["-m", "gateway"])
            proc.popen = self.spawner(proc.command, cpus=self.cpus.get(proc.name), cwd=ROOT, env=env,
                                     stdout=out, stderr=subprocess.STDOUT if out else None)
        finally:
            if out is not None:
                out.close()  # the child has its own descriptor

    def restart(self, name: str) -> Proc:
        """Start ``name`` again with the same command line (same port); SIGKILL it first if it is
        still running.  Returns at once: ``wait_ready``/``wait_for_workers`` to see it serve."""
        proc = self.procs[name]
        if proc.alive:
            self.kill(name)
        if proc.log_path is not None:
            with proc.log_path.open("a") as out:
                out.write(f"\n--- restarted (previous run: {proc.describe_exit()}) ---\n")
        self._launch(proc)
        return proc

    def worker_command(self, name: str, role: str, port: int) -> tuple[str, list[str]]:
        """The module and flags worker ``name`` runs with."""
        module = "prefill_svc" if role == "prefill" else "decode_svc"
        return module, ["--model", self.checkpoint, "--role", role, "--worker-id", name, "--port", str(port),
                        "--kv-transport", self.transport, "--key-prefix", self.key_prefix,
                        *self.worker_args, *self.role_args.get(role, [])]

    def start_worker(self, name: str, role: str) -> Proc:
        port = free_port()
        module, args = self.worker_command(name, role, port)
        return self._spawn(name, module, args, port, worker_drain_timeout(args, self.process_env()))

    def start(self, timeout: float = 180, cancelled: Callable[[], bool] = lambda: False) -> "LocalStack":
        """Start the workers and the gateway; return once the gateway routes to all of them.
        Raises ``StartCancelled`` as soon as ``cancelled()`` is true (the caller stops what started)."""
        names = ([(f"p{i}", "prefill") for i in range(self.prefill)] + [(f"d{i}", "decode") for i in range(self.decode)]
                 + [(f"b{i}", "both") for i in range(self.both)])
        for name, role in names:
            if cancelled():
                raise StartCancelled("stopped before the stack was up")
            self.start_worker(name, role)
        self.start_gateway()
        self.wait_for_workers(self.prefill, self.decode, self.both, timeout, cancelled)
        return self

    def start_gateway(self, name: str = "gateway", extra_args: list[str] | None = None) -> Proc:
        """A gateway on this stack (``start()`` runs "gateway"; tests may add others, with ``extra_args``)."""
        port = (self.gateway_port if name == "gateway" else None) or free_port()
        return self._spawn(name, "gateway", [
            "--model", self.checkpoint, "--port", str(port),
            "--key-prefix", self.key_prefix, "--routing-policy", self.policy, *self.gateway_args,
            *(extra_args or [])], port)

    def wait_for_workers(self, prefill: int, decode: int, both: int = 0, timeout: float = 60,
                         cancelled: Callable[[], bool] = lambda: False) -> dict:
        """Poll the gateway's /health until it routes to exactly this many active workers
        (``StartCancelled`` as soon as ``cancelled()`` is true)."""
        deadline = time.monotonic() + timeout
        health = None
        want = {"prefill": prefill, "decode": decode, "both": both}
        while time.monotonic() < deadline:
            if cancelled():
                raise StartCancelled("stopped before the stack was up")
            for proc in self.procs.values():
                if not proc.killed and not proc.alive:
                    raise RuntimeError(f"{proc.name} stopped ({proc.describe_exit()}):\n{proc.log()}")
            try:
                health = gateway_health(self.gateway_url)
                if health["workers"] == want:
                    return health
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        logs = "\n".join(f"--- {p.name}\n{p.log()}" for p in self.procs.values())
        raise TimeoutError(f"stack not ready (last health {health}):\n{logs}")

    def wait_ready(self, name: str, timeout: float = 60) -> None:
        """Poll one process's /health until it answers 200 (it need not be registered anywhere)."""
        proc = self.procs[name]
        deadline = time.monotonic() + timeout
        while True:
            if not proc.alive:
                raise RuntimeError(f"{name} stopped ({proc.describe_exit()}):\n{proc.log()}")
            try:
                http_json(f"{proc.url}/health", timeout=2)
                return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not ready after {timeout} s:\n{proc.log()}")
            time.sleep(0.2)

    def worker_url(self, name: str) -> str:
        return self.procs[name].url

    def worker_audience(self, name: str, timeout: float = 10) -> str:
        """What a call to the current run of worker ``name`` (its name is its worker id) is signed
        for: the instance comes from its /health (a failed worker's 503 names it too)."""
        return audience_of(name, gateway_health(self.worker_url(name), timeout)["instance"])

    def worker_json(self, name: str, path: str, method: str = "GET", body: bytes = b"",
                    headers: dict | None = None, timeout: float = 10):
        """Call a worker's internal API the way its peers do (signed with the cluster secret for
        that worker's current run)."""
        audience = self.worker_audience(name, timeout)
        signed = ClusterAuth(self.cluster_secret).sign_request(method, path, body, audience=audience)
        return http_json(self.worker_url(name) + path, method, body if method != "GET" else None,
                         {**(headers or {}), **signed}, timeout)

    def stats(self, name: str) -> dict:
        return self.worker_json(name, "/stats")

    def worker_metrics(self, name: str, timeout: float = 10) -> str:
        """A worker's Prometheus text (its ``/metrics``, signed as ``worker_json`` signs)."""
        signed = ClusterAuth(self.cluster_secret).sign_request("GET", "/metrics",
                                                               audience=self.worker_audience(name, timeout))
        req = urllib.request.Request(self.worker_url(name) + "/metrics", headers=signed)
        with urlopen(req, timeout=timeout) as resp:
            return resp.read().decode()

    def kill(self, name: str) -> None:
        """SIGKILL ``name`` (a crash; its process group with it) and wait until it is gone."""
        proc = self.procs[name]
        proc.killed = True
        if proc.popen is None:
            return
        signal_group(proc.popen, signal.SIGKILL)
        proc.popen.wait(10)
        proc.exit_status()  # reaps it

    def stop_bound(self) -> float:
        """The most ``stop()`` waits before SIGKILL: the longest drain of its processes (a worker's
        ``--drain-timeout``), plus ``stop_grace_s`` to shut down."""
        return max((p.drain_timeout_s for p in self.procs.values()), default=0.0) + self.stop_grace_s

    def stop(self, hurry: Callable[[], bool] = lambda: False) -> None:
        """SIGTERM every process at once (workers drain), wait for all of them together within
        ``stop_bound()`` (or until ``hurry()``), then SIGKILL the process groups still there."""
        stop_all([proc.popen for proc in self.procs.values()], self.stop_bound(), hurry)


def local_secret(env) -> str:
    """The cluster secret of a local stack: ``PDSERVE_CLUSTER_SECRET`` when set (and strong enough),
    else a fresh random one for this run."""
    secret = env.get(SECRET_ENV) or generate_secret()
    problem = secret_problem(secret)
    if problem:
        raise SystemExit(f"{SECRET_ENV} is not acceptable: {problem}; unset it to have one generated for the "
                         f"local stack, or set a random value of {MIN_SECRET_LEN}+ characters")
    return secret
