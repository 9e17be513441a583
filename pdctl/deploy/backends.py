"""Where workers run, for ``pdctl rollout`` and ``pdctl scale``: docker compose, or the local launcher.

A backend lists the worker replicas of each service (``prefill``, ``decode``: the role a worker
starts with), removes exact replicas, brings a service back to a count, and tells whether a
replica is up.  The orchestration (drain first, one at a time) is in ``pdctl.deploy.rollout``.
"""
from __future__ import annotations

import json
import shlex
import signal
import subprocess
from dataclasses import dataclass
from typing import Callable, Protocol

from common.cluster.direct_http import urlopen

SERVICES = ("prefill", "decode")


@dataclass(frozen=True)
class Replica:
    """One worker process or container: ``handle`` names it to the backend."""

    handle: str
    service: str
    name: str  # what the operator reads (container name, process name)
    worker_id: str | None = None  # its registry id, once it has one
    running: bool = True


class Backend(Protocol):
    def check(self, services: list[str]) -> None: ...

    def replicas(self, service: str) -> list[Replica]: ...

    def remove(self, replica: Replica, grace_s: float) -> None: ...

    def ensure(self, service: str, count: int) -> None: ...

    def healthy(self, replica: Replica) -> bool: ...


Runner = Callable[[list[str]], str]


class BackendError(Exception):
    """A backend cannot do its work here (its tool missing or not answering); the message says how to fix it."""


# What a backend raises when its command fails, times out or is not installed.
BACKEND_FAILURES = (BackendError, subprocess.SubprocessError, OSError)


def describe_failure(exc: BaseException) -> str:
    """One line for a failed backend command: which command, and what it said."""
    if isinstance(exc, subprocess.CalledProcessError):
        said = (exc.stderr or exc.stdout or "").strip().splitlines()
        return f"`{shlex.join(map(str, exc.cmd))}` exited {exc.returncode}" + (f": {said[-1]}" if said else "")
    if isinstance(exc, subprocess.TimeoutExpired):
        return f"`{shlex.join(map(str, exc.cmd))}` ran past {exc.timeout:g}s"
    if isinstance(exc, BackendError):
        return str(exc)
    if isinstance(exc, FileNotFoundError):
        return f"{exc.filename or exc}: command not found"
    return f"{type(exc).__name__}: {exc}"


def run_command(cmd: list[str]) -> str:
    """Run ``cmd``; its stdout, or CalledProcessError (with stderr) on failure."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, cmd, done.stdout, done.stderr)
    return done.stdout


class ComposeBackend:
    """Workers as containers of a compose project.

    Containers are found by the labels compose sets (``com.docker.compose.project`` and
    ``.service``); a container's worker id is what its entrypoint recorded (``entrypoint.py
    --whoami``).  Removing is ``docker stop`` (SIGTERM, then the grace period) and ``docker rm``
    of exactly that container; ``ensure`` is ``up -d --no-recreate --scale``, which creates the
    missing replicas from the current configuration and image and leaves the others alone.
    """

    def __init__(self, project: str, files: list[str], env_file: str | None, compose: str = "docker compose",
                 runner: Runner = run_command):
        self.project, self.files, self.env_file = project, files, env_file
        self.compose = shlex.split(compose)
        self.run = runner

    def compose_cmd(self, *args: str) -> list[str]:
        cmd = [*self.compose, "-p", self.project]
        if self.env_file:
            cmd += ["--env-file", self.env_file]
        for f in self.files:
            cmd += ["-f", f]
        return cmd + list(args)

    def check(self, services: list[str]) -> None:
        """Fail now, before anything is drained, if the compose tool or docker does not run
        (``docker compose`` where only docker-compose v1 is installed, for instance)."""
        try:
            self.run([*self.compose, "version"])
        except BACKEND_FAILURES as exc:
            raise BackendError(f"the compose tool does not run ({describe_failure(exc)}): install it, or pass "
                               f"--compose (e.g. --compose docker-compose) or set PDSERVE_COMPOSE") from None
        self.run(["docker", "version", "--format", "{{.Server.Version}}"])

    def replicas(self, service: str) -> list[Replica]:
        out = self.run(["docker", "ps", "-a", "--no-trunc", "--filter", f"label=com.docker.compose.project={self.project}",
                        "--filter", f"label=com.docker.compose.service={service}",
                        "--format", "{{.ID}} {{.Names}} {{.State}}"])
        replicas = []
        for line in out.splitlines():
            if not line.strip():
                continue
            cid, name, state = line.split()[:3]
            worker_id = None
            if state == "running":
                worker_id = self.worker_id(cid)
            replicas.append(Replica(cid, service, name, worker_id, running=state == "running"))
        return sorted(replicas, key=lambda r: r.name)

    def worker_id(self, container: str) -> str | None:
        try:
            info = json.loads(self.run(["docker", "exec", container, "python", "/opt/pdserve/compose/entrypoint.py",
                                        "--whoami"]) or "{}")
        except (subprocess.CalledProcessError, ValueError):
            return None  # still starting, or the entrypoint refused
        return info.get("worker_id")

    def remove(self, replica: Replica, grace_s: float) -> None:
        self.run(["docker", "stop", "--time", str(int(grace_s)), replica.handle])
        self.run(["docker", "rm", replica.handle])

    def ensure(self, service: str, count: int) -> None:
        self.run(self.compose_cmd("up", "-d", "--no-deps", "--no-recreate", "--scale", f"{service}={count}", service))

    def healthy(self, replica: Replica) -> bool:
        try:
            status = self.run(["docker", "inspect", "--format", "{{.State.Health.Status}}", replica.handle]).strip()
        except subprocess.CalledProcessError:
            return False
        return status == "healthy"


class LocalBackend:
    """Workers as processes of a ``launcher.local_stack.LocalStack`` (tests, ``make up``).

    Removing stops the process (SIGTERM: it drains, deregisters and exits); ``ensure`` starts new
    processes with fresh names, so a replaced worker is a new process like a recreated container.
    """

    def __init__(self, stack):
        self.stack = stack
        self.serial = 0

    def check(self, services: list[str]) -> None:
        """Nothing to check: the stack's processes are this process's children."""

    @staticmethod
    def _role(proc) -> str:
        args = list(proc.popen.args)
        return args[args.index("--role") + 1]

    def replicas(self, service: str) -> list[Replica]:
        return [Replica(name, service, name, name, proc.popen.poll() is None)
                for name, proc in self.stack.procs.items()
                if name != "gateway" and self._role(proc) == service]

    def remove(self, replica: Replica, grace_s: float) -> None:
        proc = self.stack.procs[replica.handle]
        proc.popen.send_signal(signal.SIGTERM)
        try:
            proc.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait(10)
        del self.stack.procs[replica.handle]

    def ensure(self, service: str, count: int) -> None:
        have = [r for r in self.replicas(service) if r.running]
        for _ in range(count - len(have)):
            self.serial += 1
            name = f"{service[0]}r{self.serial}"
            while name in self.stack.procs:
                self.serial += 1
                name = f"{service[0]}r{self.serial}"
            self.stack.start_worker(name, service)

    def healthy(self, replica: Replica) -> bool:
        proc = self.stack.procs.get(replica.handle)
        if proc is None or proc.popen.poll() is not None:
            return False
        try:
            with urlopen(f"{proc.url}/health", timeout=2) as resp:
                return json.loads(resp.read()).get("status") == "ok"
        except (OSError, ValueError):
            return False
