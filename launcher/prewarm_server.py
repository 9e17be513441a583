"""The prewarm server: a process that has imported torch and the other heavy libraries once, and
forks a child for each ``python -m MODULE ARGS`` it is asked to start (``launcher.prewarmed``).

Starting a worker the ordinary way spends seconds of CPU importing torch before it does anything;
a test suite or benchmark that starts a hundred workers on two cores spends minutes on that.  A
child forked from here starts with those modules already imported, then becomes the command it was
asked for: it leads a new session (its own process group, as ``start_child`` gives), dies with this
server (``PR_SET_PDEATHSIG``, and this server dies with its owner), takes the environment, working
directory, CPU affinity and standard output/error it was sent, and runs the module as ``python -m``
would.  The project's own modules are imported in the child, after its environment is in place
(some read it when imported); only third-party libraries are imported here, after the settings a
worker makes first (``common.engine.compute_process``: libgomp reads its OpenMP setting once, when
torch loads; the forked children inherit the malloc settings).

Protocol, over a Unix socket in a directory only this user can enter: a client connects and sends
one request (a 4-byte big-endian length, then JSON ``{"module", "args", "env", "cwd", "cpus"}``,
with the child's stdout and stderr descriptors attached as ``SCM_RIGHTS``); the server answers one
line ``{"pid": N}`` and keeps the connection: when the child exits, it SIGKILLs what is left of the
child's process group (helpers it started), reaps it and writes ``{"returncode": N}`` (negative:
killed by that signal, as ``subprocess`` reports it) before closing the connection.

Run as ``python -m launcher.prewarm_server SOCKET_PATH``: the socket is bound once the imports are
done, so a connection that succeeds reaches a server ready to fork.
"""
from __future__ import annotations

import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import types
from dataclasses import dataclass

from common.engine import compute_process

# Imported once here, shared by every child: what a worker or gateway spends most of its start on.
PRELOADED = ("torch", "numpy", "aiohttp", "aiohttp.web", "redis.asyncio", "msgspec", "uvloop", "yarl",
             "safetensors.torch", "tokenizers", "jinja2", "prometheus_client", "psutil", "xxhash")
HEADER = struct.Struct(">I")
MAX_REQUEST_BYTES = 4 << 20  # the environment and the command line: far below this
REQUEST_READ_TIMEOUT_S = 10.0
STDIO_DESCRIPTORS = 2  # stdout, stderr
ORPHAN_CHECK_S = 1.0


@dataclass
class ChildRequest:
    """What a client asked this server to start."""

    module: str
    args: list[str]
    env: dict[str, str]
    cwd: str
    cpus: list[int] | None
    stdout: int
    stderr: int

    @classmethod
    def parse(cls, payload: bytes, fds: list[int]) -> "ChildRequest":
        body = json.loads(payload)
        if not isinstance(body, dict) or len(fds) != STDIO_DESCRIPTORS:
            raise ValueError("a request is a JSON object sent with two descriptors (stdout, stderr)")
        module, args, env, cwd, cpus = (body.get(k) for k in ("module", "args", "env", "cwd", "cpus"))
        if not isinstance(module, str) or not module:
            raise ValueError("module: a non-empty string")
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValueError("args: a list of strings")
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ValueError("env: an object of strings")
        if not isinstance(cwd, str):
            raise ValueError("cwd: a string")
        if cpus is not None and (not isinstance(cpus, list) or not all(isinstance(c, int) for c in cpus)):
            raise ValueError("cpus: null or a list of integers")
        return cls(module, args, env, cwd, cpus, fds[0], fds[1])


def _read_request(conn: socket.socket) -> ChildRequest:
    conn.settimeout(REQUEST_READ_TIMEOUT_S)
    data, fds, _flags, _addr = socket.recv_fds(conn, 65536, STDIO_DESCRIPTORS)
    try:
        data = _read_at_least(conn, data, HEADER.size)
        (length,) = HEADER.unpack_from(data)
        if length > MAX_REQUEST_BYTES:
            raise ValueError(f"a request of {length} bytes (at most {MAX_REQUEST_BYTES})")
        data = _read_at_least(conn, data, HEADER.size + length)
        return ChildRequest.parse(data[HEADER.size:HEADER.size + length], fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _read_at_least(conn: socket.socket, data: bytes, size: int) -> bytes:
    """``data`` and what follows it on ``conn``, until it holds ``size`` bytes."""
    while len(data) < size:
        more = conn.recv(65536)
        if not more:
            raise ValueError("the request ended early")
        data += more
    return data


def _send_line(conn: socket.socket, body: dict) -> None:
    try:
        conn.settimeout(REQUEST_READ_TIMEOUT_S)
        conn.sendall(json.dumps(body).encode() + b"\n")
    except OSError:
        pass  # the client went away: the child runs on regardless


def _sweep_group(pid: int) -> None:
    """SIGKILL what is left of the exited child's process group (it led one), before it is reaped
    and its pid -- the group's id -- can belong to someone else."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Server:
    """Accepts requests, forks children, reports their exits.  ``serve`` returns only in a child."""

    def __init__(self, path: str):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.waiting: dict[int, socket.socket] = {}  # child pid -> the connection its exit goes to
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_write, False)
        os.set_blocking(self.wake_read, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_write)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_read, selectors.EVENT_READ, "reap")

    def serve(self) -> ChildRequest:
        owner = os.getppid()
        while True:
            if os.getppid() != owner:  # its owner is gone (started from a thread: no parent-death signal)
                sys.exit(0)
            for key, _ in self.selector.select(ORPHAN_CHECK_S):
                if key.data == "accept":
                    request = self._accept()
                    if request is not None:
                        return request  # in the child
                else:
                    self._drain_wakeups()
                    self._reap()

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self.wake_read, 4096):
                pass
        except BlockingIOError:
            pass

    def _accept(self) -> ChildRequest | None:
        conn, _ = self.listener.accept()
        try:
            request = _read_request(conn)
        except (OSError, ValueError) as exc:
            _send_line(conn, {"error": str(exc)})
            conn.close()
            return None
        try:
            pid = os.fork()
        except OSError as exc:  # out of processes or memory: this request fails, the server goes on
            os.close(request.stdout)
            os.close(request.stderr)
            _send_line(conn, {"error": f"fork failed: {exc}"})
            conn.close()
            return None
        if pid == 0:
            self._become_child(conn)
            return request
        os.close(request.stdout)
        os.close(request.stderr)
        self.waiting[pid] = conn
        _send_line(conn, {"pid": pid})
        return None

    def _become_child(self, conn: socket.socket) -> None:
        """Drop everything of the server's in a fresh child."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.selector.close()
        for fd in (self.wake_read, self.wake_write):
            os.close(fd)
        for other in self.waiting.values():
            other.close()
        self.listener.close()
        conn.close()

    def _reap(self) -> None:
        while True:
            try:
                exited = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if exited is None:
                return
            _sweep_group(exited.si_pid)
            _, status = os.waitpid(exited.si_pid, 0)
            conn = self.waiting.pop(exited.si_pid, None)
            if conn is not None:
                _send_line(conn, {"returncode": os.waitstatus_to_exitcode(status)})
                conn.close()


def become(request: ChildRequest, server_pid: int) -> None:
    """In the forked child: take the request's session, environment, descriptors and CPUs, then
    run its module as ``python -m`` does (returns when the module returns; SystemExit propagates)."""
    from common.cluster.children import die_with_parent

    os.setsid()
    arm = die_with_parent(expected_parent=server_pid)
    if arm is not None:
        arm()
    if request.cpus:
        os.sched_setaffinity(0, request.cpus)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(request.stdout, 1)
    os.dup2(request.stderr, 2)
    for fd in {devnull, request.stdout, request.stderr} - {0, 1, 2}:
        os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(request.env)
    os.chdir(request.cwd)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has them
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    _fresh_library_state(request.env)
    sys.argv = ["-m", *request.args]
    sys.modules["__main__"] = types.ModuleType("__main__")  # not this server's namespace
    if request.cwd not in sys.path:
        sys.path.insert(0, request.cwd)  # as ``python -m`` puts the working directory first
    runpy._run_module_as_main(request.module, alter_argv=True)  # what ``python -m`` runs


def _fresh_library_state(env: dict[str, str]) -> None:
    """What a library set up from the server's environment when it was imported, set again from the
    child's: torch's thread count (OpenMP read ``OMP_NUM_THREADS`` once), numpy's random state."""
    torch = sys.modules.get("torch")
    threads = env.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def main() -> None:
    path = sys.argv[1]
    compute_process.configure()  # before torch loads (its OpenMP reads the settings once): as a worker does
    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    server_pid = os.getpid()
    request = Server(path).serve()
    become(request, server_pid)


if __name__ == "__main__":
    main()
