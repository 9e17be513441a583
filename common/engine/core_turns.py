"""Engine steps of the workers that share one host's cores, taken in turns.

``make up`` runs a prefill and a decode worker on the same CPU cores, each with a thread team for
every core.  When both compute at once the teams are twice as many threads as cores, and every
parallel region waits at its barrier for a descheduled thread: measured on 2 vCPUs (Gemma 3 270M,
fp32), a 512-token prefill step took 347 ms alone and 1,192 ms beside a decode worker whose
8-request steps went from 35 to 217 ms -- together the two made 45% of the progress either makes
alone.  Taking turns, each step has every core to itself.

A turn is an exclusive ``flock`` on the lock file.  A turnstile before it keeps the turns fair:
a worker first locks ``<file>.queue``, then the lock file, then lets the queue go; so a worker
that finishes a step and comes back while another waits finds the queue held by the waiter, and
goes after it.  Locks are polled (up to ``MAX_POLL_S`` apart), never waited on blindly: past
``wait_limit_s`` the step runs without its turn, counted in ``missed``, and so do the next ones
without waiting while the lock stays taken (a peer that hangs in its step costs this worker one
wait and the contention of sharing the cores, not its liveness).  The kernel drops a dead
process's locks, so a worker that crashes mid-step frees the cores at once.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

MIN_POLL_S = 50e-6
MAX_POLL_S = 0.5e-3
WAIT_LIMIT_S = 30.0


class CoreTurns:
    """Turns on ``path`` (created if missing, mode 0600); ``turn()`` holds one around a step.

    ``turns`` counts the turns taken, ``missed`` the steps that ran without one (``wait_limit_s``
    passed), ``waited_s`` the time spent waiting.
    """

    def __init__(self, path: str | Path, wait_limit_s: float = WAIT_LIMIT_S):
        if not wait_limit_s > 0:
            raise ValueError(f"core turns: wait_limit_s must be > 0 seconds, got {wait_limit_s}")
        self.path = Path(path)
        self.wait_limit_s = wait_limit_s
        self.turns = 0
        self.missed = 0
        self.waited_s = 0.0
        self._stuck = False  # the last turn was missed: do not wait again until the lock is free
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = os.open(self.path, flags, 0o600)
        try:
            self._queue = os.open(f"{self.path}.queue", flags, 0o600)
        except OSError:
            os.close(self._lock)
            raise

    def __repr__(self) -> str:
        return f"CoreTurns({str(self.path)!r}, turns={self.turns}, missed={self.missed})"

    @contextlib.contextmanager
    def turn(self) -> Iterator[bool]:
        """Hold a turn for the block; yields whether it got one (False: ran without, see above)."""
        began = time.monotonic()
        deadline = began + (0.0 if self._stuck else self.wait_limit_s)
        queued = _lock_by(self._queue, deadline)
        held = _lock_by(self._lock, deadline)
        if queued:
            fcntl.flock(self._queue, fcntl.LOCK_UN)
        self.waited_s += time.monotonic() - began
        if held:
            self.turns += 1
        else:
            self.missed += 1
            if not self._stuck:
                log.warning("core turns: no turn on %s within %.0f s; steps run beside another worker's until "
                            "it lets go", self.path, self.wait_limit_s)
        self._stuck = not held
        try:
            yield held
        finally:
            if held:
                fcntl.flock(self._lock, fcntl.LOCK_UN)

    def close(self) -> None:
        for fd in (self._lock, self._queue):
            with contextlib.suppress(OSError):
                os.close(fd)


def _lock_by(fd: int, deadline: float) -> bool:
    """Lock ``fd`` exclusively, polling with a growing pause; False once ``deadline`` passes."""
    pause = MIN_POLL_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        now = time.monotonic()
        if now >= deadline:
            return False
        time.sleep(min(pause, deadline - now))
        pause = min(2 * pause, MAX_POLL_S)
