"""Start ``python -m MODULE`` processes from a prewarmed server (``launcher.prewarm_server``) that
has already imported torch and the other heavy libraries: for test suites and benchmarks that
start many stacks on few cores, where every worker would otherwise spend seconds importing.

``PrewarmedStarter`` is a ``LocalStack.spawner``: called like ``common.cluster.children.start_child``,
it asks its server to fork the command and returns a ``PrewarmedProcess`` (``subprocess.Popen``'s
``poll``/``wait``/``send_signal``/``terminate``/``kill``/``pid``/``returncode``).  A command that is
not ``sys.executable -m MODULE ...`` (a wrapper such as ``ip netns exec``), and any command while
the server cannot be reached, starts the ordinary way.  ``make up`` does not use it: a deployment
starts each process from a fresh interpreter.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Iterable

from common.cluster.children import start_child
from launcher.prewarm_server import HEADER

ROOT = Path(__file__).resolve().parents[1]
SERVER_READY_TIMEOUT_S = 120.0  # its imports, on a loaded machine
ANSWER_TIMEOUT_S = 30.0  # a fork and one line back
POLL_S = 0.05


class PrewarmedProcess:
    """A process the prewarm server forked on this process's behalf.  Its exit status arrives over
    the connection that asked for it (the server reaps it, after sweeping its process group)."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket):
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn
        self._buffer = b""
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"PrewarmedProcess(pid={self.pid}, returncode={self.returncode})"

    def poll(self) -> int | None:
        return self._collect(0)

    def wait(self, timeout: float | None = None) -> int:
        status = self._collect(timeout)
        if status is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return status

    def _collect(self, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self.returncode is None:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not select.select([self._conn], [], [], left)[0]:
                    return None
                try:
                    data = self._conn.recv(4096)
                except OSError:
                    data = b""
                if not data:  # the server is gone, and its children with it (PR_SET_PDEATHSIG)
                    self._finish(-signal.SIGKILL)
                    break
                self._buffer += data
                if b"\n" in self._buffer:
                    line = self._buffer.split(b"\n", 1)[0]
                    try:
                        self._finish(int(json.loads(line)["returncode"]))
                    except (ValueError, KeyError, TypeError):
                        self._finish(-signal.SIGKILL)
            return self.returncode

    def _finish(self, returncode: int) -> None:
        self.returncode = returncode
        self._conn.close()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class PrewarmedStarter:
    """One prewarm server, started on first use from the calling thread (it dies with this process),
    and the ``spawner`` that forks commands from it.  ``close()`` stops the server and its children."""

    def __init__(self, env: dict[str, str] | None = None):
        self._env = env
        self._server: subprocess.Popen | None = None
        self._directory: str | None = None
        self._lock = threading.Lock()
        self._unavailable = False

    @property
    def socket_path(self) -> str:
        assert self._directory is not None
        return os.path.join(self._directory, "server.sock")

    def start(self) -> "PrewarmedStarter":
        """Start the server (returns at once: the first spawn waits for it)."""
        with self._lock:
            if self._server is None:
                self._directory = tempfile.mkdtemp(prefix="pdserve-prewarm-")  # mode 0700
                env = dict(os.environ if self._env is None else self._env)
                env.pop("OMP_NUM_THREADS", None)  # each child sets its own thread count from its environment
                self._server = start_child([sys.executable, "-m", "launcher.prewarm_server", self.socket_path],
                                           cwd=ROOT, env=env, stdin=subprocess.DEVNULL)
        return self

    def close(self) -> None:
        with self._lock:
            server, self._server = self._server, None
            if server is not None and server.poll() is None:
                server.kill()
                server.wait()
            if self._directory is not None:
                shutil.rmtree(self._directory, ignore_errors=True)
                self._directory = None

    def __call__(self, command: list[str], *, cpus: Iterable[int] | None = None, cwd: str | os.PathLike = ROOT,
                 env: dict[str, str] | None = None, stdout: IO | int | None = None, stderr: IO | int | None = None,
                 **popen_kwargs):
        """``start_child(command, ...)``, forked from the server when it can be."""
        module = _python_module(command)
        if module is None or popen_kwargs or self._unavailable or not _forwardable(stdout, stderr):
            return start_child(command, cpus=cpus, cwd=cwd, env=env, stdout=stdout, stderr=stderr, **popen_kwargs)
        try:
            return self._fork(command, module, cpus, cwd, env, stdout, stderr)
        except (OSError, ValueError) as exc:  # no server, or an answer that is not one
            self._unavailable = True
            print(f"prewarm server unavailable ({exc}): processes start the ordinary way", file=sys.stderr)
            return start_child(command, cpus=cpus, cwd=cwd, env=env, stdout=stdout, stderr=stderr)

    def _fork(self, command, module, cpus, cwd, env, stdout, stderr) -> PrewarmedProcess:
        out_fd = _descriptor(stdout, 1)
        err_fd = out_fd if stderr == subprocess.STDOUT else _descriptor(stderr, 2)
        body = json.dumps({"module": module, "args": command[3:], "env": dict(os.environ if env is None else env),
                           "cwd": os.fspath(cwd), "cpus": sorted(cpus) if cpus else None}).encode()
        conn = self._connect()
        try:
            socket.send_fds(conn, [HEADER.pack(len(body)) + body], [out_fd, err_fd])
            conn.settimeout(ANSWER_TIMEOUT_S)
            line = b""
            while b"\n" not in line:
                more = conn.recv(4096)
                if not more:
                    raise ConnectionError("the prewarm server closed the connection without an answer")
                line += more
            answer = json.loads(line.split(b"\n", 1)[0])
            if "pid" not in answer:
                raise ConnectionError(f"the prewarm server refused: {answer.get('error')}")
            conn.settimeout(None)
            return PrewarmedProcess(list(command), int(answer["pid"]), conn)
        except BaseException:
            conn.close()
            raise

    def _connect(self) -> socket.socket:
        self.start()
        deadline = time.monotonic() + SERVER_READY_TIMEOUT_S
        while True:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(self.socket_path)
                return conn
            except (FileNotFoundError, ConnectionRefusedError):
                conn.close()
                server = self._server
                if server is None or server.poll() is not None:
                    raise ConnectionError("the prewarm server is not running")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the prewarm server did not listen within {SERVER_READY_TIMEOUT_S:g} s")
                time.sleep(POLL_S)


def _python_module(command: list[str]) -> str | None:
    """MODULE for ``[sys.executable, "-m", MODULE, ...]``, else None."""
    if len(command) >= 3 and command[0] == sys.executable and command[1] == "-m":
        return command[2]
    return None


def _forwardable(stdout, stderr) -> bool:
    """Whether the streams are descriptors the server can be handed (not ``PIPE``/``DEVNULL``)."""
    return not (isinstance(stdout, int) and stdout < 0) and not (
        isinstance(stderr, int) and stderr < 0 and stderr != subprocess.STDOUT)


def _descriptor(stream: IO | int | None, default: int) -> int:
    if stream is None:
        return default
    return stream if isinstance(stream, int) else stream.fileno()
