"""Start a whole stack as local processes: Redis (if none answers), workers, the gateway.

``make up`` runs ``python -m common.cluster.launcher``: it starts the stack, then supervises it (a
process that exits is restarted with backoff while the rest keep serving) until Ctrl-C/SIGTERM.
The integration tests and the serving benchmark use ``LocalStack`` to start real processes the same
way (and ``LocalStack.restart`` to bring one back).  Every process of a stack gets the same
cluster secret (``PDSERVE_CLUSTER_SECRET`` from the environment, or a fresh random one), and the
rest of the launcher's environment (``PDSERVE_ADMIN_TOKEN``, ...) as well.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from common.cluster.auth import MIN_SECRET_LEN, SECRET_ENV, ClusterAuth, generate_secret, secret_problem
from common.cluster.flags import EnvFlags

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, method: str = "GET", body: bytes | None = None, headers: dict | None = None,
              timeout: float = 10):
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
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
    """One process of a stack and how to start it again (same module, arguments and port)."""

    name: str
    module: str
    args: list[str]
    url: str
    log_path: Path | None
    popen: subprocess.Popen | None = None
    started_at: float = 0.0  # time.monotonic() of the last start
    killed: bool = False  # stopped on purpose (by a test): not an error for wait_for_workers

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path else ""

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


@dataclass
class LocalStack:
    """``prefill`` prefill workers, ``decode`` decode workers and a gateway on one checkpoint.

    Logs go to ``workdir/<name>.log`` (or the terminal when ``workdir`` is None).  Every process
    gets ``cluster_secret`` (a fresh random one unless given), so workers check every call and
    ``worker_json`` signs its own.
    """

    checkpoint: str
    redis_url: str
    key_prefix: str = "pdserve"
    workdir: Path | None = None
    prefill: int = 1
    decode: int = 1
    both: int = 0
    transport: str = "tcp"
    policy: str = "prefix_aware"
    gateway_port: int | None = None
    worker_args: list[str] = field(default_factory=list)
    role_args: dict[str, list[str]] = field(default_factory=dict)  # extra worker args by role (after worker_args)
    gateway_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    cpus: dict[str, list[int]] = field(default_factory=dict)  # CPU affinity by process name (benchmarks)
    cluster_secret: str = field(default_factory=generate_secret, repr=False)
    procs: dict[str, Proc] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        """The served model id (the checkpoint directory's name, as workers and gateway derive it)."""
        return Path(self.checkpoint).name

    @property
    def gateway_url(self) -> str:
        return self.procs["gateway"].url

    def process_env(self) -> dict[str, str]:
        """The environment every process of the stack starts with."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **self.extra_env)
        env.pop("PDSERVE_CLUSTER_SECRET_FILE", None)  # it would take precedence over the stack's secret
        env[SECRET_ENV] = self.cluster_secret
        return env

    def _spawn(self, name: str, module: str, args: list[str], port: int) -> Proc:
        log_path = self.workdir / f"{name}.log" if self.workdir else None
        if log_path is not None:
            log_path.write_text("")
        proc = Proc(name, module, list(args), f"http://127.0.0.1:{port}", log_path)
        self.procs[name] = proc
        self._launch(proc)
        return proc

    def _launch(self, proc: Proc) -> None:
        out = proc.log_path.open("a") if proc.log_path else None
        try:
            cpus = self.cpus.get(proc.name)
            # Pinned before exec, so every thread the process starts (OpenMP's too) inherits it.
            pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
            proc.popen = subprocess.Popen([sys.executable, "-m", proc.module, *proc.args], cwd=ROOT,
                                          env=self.process_env(), stdout=out,
                                          stderr=subprocess.STDOUT if out else None, preexec_fn=pin)
        finally:
            if out is not None:
                out.close()  # the child has its own descriptor
        proc.started_at = time.monotonic()
        proc.killed = False

    def restart(self, name: str) -> Proc:
        """Start ``name`` again with the same command line (same port); SIGKILL it first if it is
        still running.  Returns at once: ``wait_ready``/``wait_for_workers`` to see it serve."""
        proc = self.procs[name]
        if proc.alive:
            self.kill(name)
        if proc.log_path is not None:
            with proc.log_path.open("a") as out:
                out.write(f"\n--- restarted (previous exit status {proc.popen.returncode}) ---\n")
        self._launch(proc)
        return proc

    def start_worker(self, name: str, role: str) -> Proc:
        port = free_port()
        module = "prefill_svc" if role == "prefill" else "decode_svc"
        args = ["--model", self.checkpoint, "--role", role, "--worker-id", name, "--port", str(port),
                "--kv-transport", self.transport, "--redis-url", self.redis_url, "--key-prefix", self.key_prefix,
                *self.worker_args, *self.role_args.get(role, [])]
        return self._spawn(name, module, args, port)

    def start(self, timeout: float = 180) -> "LocalStack":
        names = ([(f"p{i}", "prefill") for i in range(self.prefill)] + [(f"d{i}", "decode") for i in range(self.decode)]
                 + [(f"b{i}", "both") for i in range(self.both)])
        for name, role in names:
            self.start_worker(name, role)
        self.start_gateway()
        self.wait_for_workers(self.prefill, self.decode, self.both, timeout)
        return self

    def start_gateway(self, name: str = "gateway", extra_args: list[str] | None = None) -> Proc:
        """A gateway on this stack (``start()`` runs "gateway"; tests may add others, with ``extra_args``)."""
        port = (self.gateway_port if name == "gateway" else None) or free_port()
        return self._spawn(name, "gateway", [
            "--model", self.checkpoint, "--port", str(port), "--redis-url", self.redis_url,
            "--key-prefix", self.key_prefix, "--routing-policy", self.policy, *self.gateway_args,
            *(extra_args or [])], port)

    def wait_for_workers(self, prefill: int, decode: int, both: int = 0, timeout: float = 60) -> dict:
        """Poll the gateway's /health until it routes to exactly this many active workers."""
        deadline = time.monotonic() + timeout
        health = None
        want = {"prefill": prefill, "decode": decode, "both": both}
        while time.monotonic() < deadline:
            for proc in self.procs.values():
                if not proc.killed and not proc.alive:
                    raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log()}")
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
                raise RuntimeError(f"{name} exited with {proc.popen.returncode}:\n{proc.log()}")
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

    def worker_json(self, name: str, path: str, method: str = "GET", body: bytes = b"",
                    headers: dict | None = None, timeout: float = 10):
        """Call a worker's internal API the way its peers do (signed with the cluster secret)."""
        signed = ClusterAuth(self.cluster_secret).sign_request(method, path, body, audience=name)
        return http_json(self.worker_url(name) + path, method, body if method != "GET" else None,
                         {**(headers or {}), **signed}, timeout)

    def stats(self, name: str) -> dict:
        return self.worker_json(name, "/stats")

    def kill(self, name: str) -> None:
        """SIGKILL ``name`` (a crash) and wait until it is gone."""
        proc = self.procs[name]
        proc.killed = True
        proc.popen.kill()
        proc.popen.wait(10)

    def stop(self) -> None:
        """SIGTERM every process (workers drain, bounded), SIGKILL what is still there after 15 s."""
        for proc in self.procs.values():
            if proc.alive:
                proc.popen.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.popen.wait(15)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(5)


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


class Supervisor:
    """Keeps a ``LocalStack`` (and the private Redis it may use) running until told to stop.

    A process that exits (killed, crashed, or a worker whose engine failed) is started again with
    the same command line after a backoff: ``min_backoff`` seconds, doubling with each exit that
    follows a short run, up to ``max_backoff``; a process that stays up ``stable_after`` seconds
    starts from ``min_backoff`` again.  The other processes keep serving meanwhile.

    A crash loop ends: after ``crash_loop_limit`` short runs in a row a process is given up (named
    in ``given_up``, not started again).  A worker given up leaves the rest serving; the gateway
    or the private Redis given up makes ``failed`` true, since nothing can serve without them, and
    ``run()`` returns.  Call ``poll()`` periodically (``run()`` does), from the thread that owns the
    stack.
    """

    ESSENTIAL = ("gateway", "redis")

    def __init__(self, stack: LocalStack, redis_server=None, *, min_backoff: float = 1.0,
                 max_backoff: float = 30.0, stable_after: float = 60.0, crash_loop_limit: int = 10, say=print):
        if not 0 < min_backoff <= max_backoff:
            raise ValueError(f"backoff must satisfy 0 < min_backoff <= max_backoff, got {min_backoff}, {max_backoff}")
        if crash_loop_limit < 1:
            raise ValueError(f"crash_loop_limit must be >= 1, got {crash_loop_limit}")
        self.stack = stack
        self.redis_server = redis_server
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff
        self.stable_after = stable_after
        self.crash_loop_limit = crash_loop_limit
        self.say = say
        self.restarts: dict[str, int] = {}
        self.given_up: set[str] = set()
        self._quick_exits: dict[str, int] = {}  # exits in a row that followed a short run
        self._due: dict[str, float] = {}  # name -> when to start it again
        self._redis_started = time.monotonic()

    @property
    def failed(self) -> bool:
        """True once the gateway or the private Redis was given up: the stack cannot serve."""
        return any(name in self.given_up for name in self.ESSENTIAL)

    def backoff(self, name: str) -> float:
        return min(self.max_backoff, self.min_backoff * 2 ** self._quick_exits.get(name, 0))

    def poll(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.redis_server is not None:
            self._watch("redis", self.redis_server.proc.poll(), self._redis_started, now)
        for name, proc in self.stack.procs.items():
            self._watch(name, proc.popen.poll(), proc.started_at, now)

    def _watch(self, name: str, returncode: int | None, started_at: float, now: float) -> None:
        if returncode is None:
            if now - started_at >= self.stable_after:
                self._quick_exits.pop(name, None)
            return
        if name in self.given_up:
            return
        due = self._due.get(name)
        if due is None:
            if now - started_at < self.stable_after and self._quick_exits.get(name, 0) + 1 >= self.crash_loop_limit:
                self.given_up.add(name)
                self.say(f"{name} stopped ({describe_exit(returncode)}) {self.crash_loop_limit} times in a row "
                         f"within {self.stable_after:g} s of starting; not restarting it (crash loop)"
                         + ("" if name not in self.ESSENTIAL else "; the stack cannot serve without it"), flush=True)
                return
            delay = self.backoff(name)
            self._due[name] = now + delay
            self.say(f"{name} stopped ({describe_exit(returncode)}); restarting it in {delay:.2f} s", flush=True)
            return
        if now < due:
            return
        del self._due[name]
        if now - started_at < self.stable_after:
            self._quick_exits[name] = self._quick_exits.get(name, 0) + 1
        self.restarts[name] = self.restarts.get(name, 0) + 1
        try:
            if name == "redis":
                self.redis_server.start()
                self._redis_started = time.monotonic()
            else:
                self.stack.restart(name)
        except Exception as exc:  # e.g. the port is taken: try again after the next backoff
            self.say(f"could not restart {name}: {exc}", flush=True)
            return
        self.say(f"{name} restarted (restart #{self.restarts[name]})", flush=True)

    def run(self, should_stop, interval: float = 0.2) -> None:
        """Supervise until ``should_stop()`` is true (or the stack ``failed``)."""
        while not should_stop() and not self.failed:
            self.poll()
            time.sleep(interval)


def default_transport() -> str:
    try:
        import ucxx  # noqa: F401

        return "ucx"
    except Exception:
        return "tcp"


def local_secret(env) -> str:
    """The cluster secret of a local stack: ``PDSERVE_CLUSTER_SECRET`` when set (and strong enough),
    else a fresh random one for this run."""
    secret = env.get(SECRET_ENV) or generate_secret()
    problem = secret_problem(secret)
    if problem:
        raise SystemExit(f"{SECRET_ENV} is not acceptable: {problem}; unset it to have one generated for the "
                         f"local stack, or set a random value of {MIN_SECRET_LEN}+ characters")
    return secret


def main() -> None:
    from common.cluster.redis_util import ensure_redis, redis_url_from_env

    parser = argparse.ArgumentParser(
        description="Run gateway + prefill + decode workers locally and keep them running (make up). "
                    "Every flag also reads PDSERVE_<FLAG>; the processes it starts read theirs too.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    flags = EnvFlags(parser, aliases={"port": ("PDSERVE_GATEWAY_PORT",)})
    flags.add("--model", "default")
    flags.add("--port", 8000, int, help="the gateway's port (also PDSERVE_GATEWAY_PORT)")
    flags.add("--prefill", 1, int, help="prefill workers")
    flags.add("--decode", 1, int, help="decode workers")
    flags.add("--kv-transport", default_transport(), choices=("ucx", "tcp"))
    flags.add("--num-blocks", 2048, int, help="KV blocks per worker")
    flags.add("--key-prefix", "pdserve", help="Redis key prefix of this stack's registry and prefix index")
    flags.add("--restart-backoff", 1.0, float,
              help="seconds before a process that exited is started again (doubles while it keeps exiting soon "
                   "after starting, up to 30 s)")
    flags.add("--crash-loop-limit", 10, int,
              help="a process that exits this many times in a row within 60 s of starting is not started again "
                   "(a worker: the rest keep serving; the gateway or the private Redis: the launcher stops, exit 1)")
    args = parser.parse_args()

    if args.model == "default":
        from common.engine.default_model import ensure_default_model

        print("preparing the default model (Gemma 3 270M; converted once, then cached)...", flush=True)
        ensure_default_model()
    secret = local_secret(os.environ)
    url, redis_server = ensure_redis(redis_url_from_env())
    if redis_server is not None:
        print(f"no Redis answered at {redis_url_from_env()}; started a private one at {url}", flush=True)
    stack = LocalStack(args.model, url, key_prefix=args.key_prefix, prefill=args.prefill, decode=args.decode,
                       transport=args.kv_transport, gateway_port=args.port,
                       worker_args=["--num-blocks", str(args.num_blocks)], cluster_secret=secret)
    stop = False
    supervising = False

    def on_signal(_sig, _frame):
        nonlocal stop
        stop = True
        if not supervising:
            raise KeyboardInterrupt  # still starting: give up at once (the finally stops what started)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        stack.start(timeout=600)
        model = http_json(f"{stack.gateway_url}/v1/models")["data"][0]["id"]
        print(f"""
pdserve is up: {stack.gateway_url}  (model {model}; {args.prefill} prefill + {args.decode} decode, KV over {args.kv_transport})

  curl {stack.gateway_url}/v1/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "{model}", "prompt": "The capital of France is", "max_tokens": 16, "stream": true}}'

A process that stops is restarted; Ctrl-C stops everything.""", flush=True)
        supervising = True
        supervisor = Supervisor(stack, redis_server, min_backoff=args.restart_backoff,
                                max_backoff=max(30.0, args.restart_backoff), crash_loop_limit=args.crash_loop_limit)
        supervisor.run(lambda: stop)
    finally:
        print("stopping...", flush=True)
        stack.stop()
        if redis_server is not None:
            redis_server.stop()
    if supervisor.failed:
        raise SystemExit(f"stopped: {', '.join(sorted(supervisor.given_up))} kept crashing")


if __name__ == "__main__":
    main()
