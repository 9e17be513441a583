"""Child processes for tests that run with UCX loaded, started without ``fork()``.

uvloop's ``create_subprocess_exec`` forks (libuv's ``uv_spawn``), and a forked child runs the
parent's ``pthread_atfork`` handlers before it execs: uvloop's handler unmaps memory, which enters
UCX's memory hook, which takes a UCX registration-cache lock -- and if a UCX thread of the parent
held that lock at the moment of the fork, the child spins on it for ever (seen once in a full run).
``subprocess.Popen`` starts the child with ``vfork()``/``posix_spawn`` (no ``preexec_fn``), which
runs no fork handlers; its standard output is read here through the event loop, so tests still
await the child's lines.
"""
from __future__ import annotations

import asyncio
import subprocess
from typing import Sequence


class SpawnedProcess:
    """A child whose standard output (and, if asked, standard error) is an ``asyncio.StreamReader``."""

    def __init__(self, proc: subprocess.Popen, stdout: asyncio.StreamReader, transport: asyncio.BaseTransport):
        self.proc = proc
        self.stdout = stdout
        self._transport = transport

    @classmethod
    async def start(cls, argv: Sequence[str], *, cwd: str | None = None, env: dict[str, str] | None = None,
                    merge_stderr: bool = False) -> "SpawnedProcess":
        proc = subprocess.Popen(list(argv), cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT if merge_stderr else None, close_fds=True)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 20)
        try:
            transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), proc.stdout)
        except BaseException:
            proc.kill()
            proc.wait()
            proc.stdout.close()
            raise
        return cls(proc, reader, transport)

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    async def wait(self, timeout: float | None = None) -> int:
        """The child's exit status; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        return await asyncio.to_thread(self.proc.wait, timeout)

    async def read_all(self, timeout: float) -> bytes:
        """Everything the child writes until it closes its output (``asyncio.TimeoutError`` after ``timeout``)."""
        return await asyncio.wait_for(self.stdout.read(), timeout)

    async def kill(self) -> None:
        """Kill the child if it still runs, reap it and close the pipe."""
        if self.proc.poll() is None:
            self.proc.kill()
        await self.wait()
        self._transport.close()
