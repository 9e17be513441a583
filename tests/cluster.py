"""Real processes for integration tests: gateway, prefill and decode workers, against real Redis."""
from __future__ import annotations

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

ROOT = Path(__file__).resolve().parent.parent


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
    log_path: Path
    url: str
    killed: bool = False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


@dataclass
class Cluster:
    """Starts ``prefill`` prefill workers, ``decode`` decode workers and a gateway on ``checkpoint``."""

    checkpoint: Path
    workdir: Path
    redis_url: str
    key_prefix: str
    prefill: int = 2
    decode: int = 1
    transport: str = "tcp"
    policy: str = "prefix_aware"
    worker_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    procs: dict[str, Proc] = field(default_factory=dict)

    @property
    def gateway_url(self) -> str:
        return self.procs["gateway"].url

    def _spawn(self, name: str, module: str, args: list[str], port: int) -> Proc:
        log_path = self.workdir / f"{name}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        popen = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                                 stdout=log_path.open("w"), stderr=subprocess.STDOUT)
        proc = Proc(name, popen, log_path, f"http://127.0.0.1:{port}")
        self.procs[name] = proc
        return proc

    def start_worker(self, name: str, role: str) -> Proc:
        port = free_port()
        module = "prefill_svc" if role == "prefill" else "decode_svc"
        args = ["--model", str(self.checkpoint), "--role", role, "--worker-id", name, "--port", str(port),
                "--kv-transport", self.transport, "--redis-url", self.redis_url, "--key-prefix", self.key_prefix,
                "--heartbeat-ttl", "2", "--admin-token", "admin-secret", "--log-level", "INFO", *self.worker_args]
        return self._spawn(name, module, args, port)

    def start(self, timeout: float = 120) -> "Cluster":
        for i in range(self.prefill):
            self.start_worker(f"p{i}", "prefill")
        for i in range(self.decode):
            self.start_worker(f"d{i}", "decode")
        port = free_port()
        self._spawn("gateway", "gateway", [
            "--model", str(self.checkpoint), "--port", str(port), "--redis-url", self.redis_url,
            "--key-prefix", self.key_prefix, "--routing-policy", self.policy, "--admin-token", "admin-secret",
            *self.gateway_args], port)
        self.wait_for_workers(self.prefill, self.decode, timeout)
        return self

    def wait_for_workers(self, prefill: int, decode: int, timeout: float = 60) -> dict:
        """Poll the gateway's /health until it routes to exactly this many active workers."""
        deadline = time.monotonic() + timeout
        health = None
        while time.monotonic() < deadline:
            for proc in self.procs.values():
                if proc.popen.poll() is not None and proc.name in self.expected_alive:
                    raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log()}")
            try:
                health = http_json(f"{self.gateway_url}/health", timeout=2)
                if health["workers"]["prefill"] == prefill and health["workers"]["decode"] == decode:
                    return health
            except OSError:
                pass
            time.sleep(0.2)
        logs = "\n".join(f"--- {p.name}\n{p.log()}" for p in self.procs.values())
        raise TimeoutError(f"cluster not ready (last health {health}):\n{logs}")

    @property
    def expected_alive(self) -> set[str]:
        return {name for name, p in self.procs.items() if not p.killed}

    def worker_url(self, name: str) -> str:
        return self.procs[name].url

    def stats(self, name: str) -> dict:
        return http_json(f"{self.worker_url(name)}/stats")

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
