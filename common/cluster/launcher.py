"""Start a whole stack as local processes: Redis (if none answers), workers, the gateway.

``make up`` runs ``python -m common.cluster.launcher``; the integration tests and the serving benchmark
use ``LocalStack`` to start real processes the same way.  Every process of a stack gets the same
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
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from common.cluster.auth import MIN_SECRET_LEN, SECRET_ENV, ClusterAuth, generate_secret, secret_problem

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


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path | None
    url: str
    killed: bool = False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path else ""


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
    gateway_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
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
        env = self.process_env()
        log_path = self.workdir / f"{name}.log" if self.workdir else None
        out = log_path.open("w") if log_path else None
        popen = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                                 stdout=out, stderr=subprocess.STDOUT if out else None)
        proc = Proc(name, popen, log_path, f"http://127.0.0.1:{port}")
        self.procs[name] = proc
        return proc

    def start_worker(self, name: str, role: str) -> Proc:
        port = free_port()
        module = "prefill_svc" if role == "prefill" else "decode_svc"
        args = ["--model", self.checkpoint, "--role", role, "--worker-id", name, "--port", str(port),
                "--kv-transport", self.transport, "--redis-url", self.redis_url, "--key-prefix", self.key_prefix,
                *self.worker_args]
        return self._spawn(name, module, args, port)

    def start(self, timeout: float = 180) -> "LocalStack":
        names = ([(f"p{i}", "prefill") for i in range(self.prefill)] + [(f"d{i}", "decode") for i in range(self.decode)]
                 + [(f"b{i}", "both") for i in range(self.both)])
        for name, role in names:
            self.start_worker(name, role)
        port = self.gateway_port or free_port()
        self._spawn("gateway", "gateway", [
            "--model", self.checkpoint, "--port", str(port), "--redis-url", self.redis_url,
            "--key-prefix", self.key_prefix, "--routing-policy", self.policy, *self.gateway_args], port)
        self.wait_for_workers(self.prefill, self.decode, self.both, timeout)
        return self

    def wait_for_workers(self, prefill: int, decode: int, both: int = 0, timeout: float = 60) -> dict:
        """Poll the gateway's /health until it routes to exactly this many active workers."""
        deadline = time.monotonic() + timeout
        health = None
        want = {"prefill": prefill, "decode": decode, "both": both}
        while time.monotonic() < deadline:
            for proc in self.procs.values():
                if not proc.killed and proc.popen.poll() is not None:
                    raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log()}")
            try:
                health = http_json(f"{self.gateway_url}/health", timeout=2)
                if health["workers"] == want:
                    return health
            except OSError:
                pass
            time.sleep(0.2)
        logs = "\n".join(f"--- {p.name}\n{p.log()}" for p in self.procs.values())
        raise TimeoutError(f"stack not ready (last health {health}):\n{logs}")

    def wait_ready(self, name: str, timeout: float = 60) -> None:
        """Poll one process's /health until it answers 200 (it need not be registered anywhere)."""
        proc = self.procs[name]
        deadline = time.monotonic() + timeout
        while True:
            if proc.popen.poll() is not None:
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
        signed = ClusterAuth(self.cluster_secret).sign_request(method, path, body)
        return http_json(self.worker_url(name) + path, method, body if method != "GET" else None,
                         {**(headers or {}), **signed}, timeout)

    def stats(self, name: str) -> dict:
        return self.worker_json(name, "/stats")

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.killed = True
        proc.popen.kill()
        proc.popen.wait(10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.popen.wait(15)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(5)


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

    parser = argparse.ArgumentParser(description="Run gateway + prefill + decode workers locally (make up)")
    parser.add_argument("--model", default=os.environ.get("PDSERVE_MODEL", "default"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("PDSERVE_GATEWAY_PORT", "8000")))
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--kv-transport", default=os.environ.get("PDSERVE_KV_TRANSPORT") or default_transport())
    parser.add_argument("--num-blocks", default=os.environ.get("PDSERVE_NUM_BLOCKS", "2048"))
    args = parser.parse_args()

    if args.model == "default":
        from common.engine.default_model import ensure_default_model

        print("preparing the default model (Gemma 3 270M; converted once, then cached)...", flush=True)
        ensure_default_model()
    secret = local_secret(os.environ)
    url, redis_server = ensure_redis(redis_url_from_env())
    if redis_server is not None:
        print(f"no Redis answered at {redis_url_from_env()}; started a private one at {url}", flush=True)
    stack = LocalStack(args.model, url, prefill=args.prefill, decode=args.decode, transport=args.kv_transport,
                       gateway_port=args.port, worker_args=["--num-blocks", str(args.num_blocks)],
                       cluster_secret=secret)
    stop = False

    def on_signal(_sig, _frame):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        stack.start(timeout=600)
        model = http_json(f"{stack.gateway_url}/v1/models")["data"][0]["id"]
        print(f"""
pdserve is up: {stack.gateway_url}  (model {model}; {args.prefill} prefill + {args.decode} decode, KV over {args.kv_transport})

  curl {stack.gateway_url}/v1/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "{model}", "prompt": "The capital of France is", "max_tokens": 16, "stream": true}}'

Ctrl-C stops everything.""", flush=True)
        while not stop and all(p.popen.poll() is None for p in stack.procs.values()):
            time.sleep(0.5)
    finally:
        print("stopping...", flush=True)
        stack.stop()
        if redis_server is not None:
            redis_server.stop()


if __name__ == "__main__":
    main()
