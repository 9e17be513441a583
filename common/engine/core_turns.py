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

A stopped or hung peer keeps its lock, though, and a limit long enough for any real step (a
2048-token prefill chunk in fp32 takes seconds on a slow CPU) stalled every other worker on the
host that long (a worker frozen by SIGSTOP: its peers' streams stopped for the whole 30 s).  So
the holder of a turn writes into the lock file when it began and the longest of its recent turns
(``TURN_RECORD``; when it let go, once it does), and a waiter stops waiting once the turn has lasted
``PATIENCE_TURNS`` times that longest turn, and at least ``patience_floor_s`` -- within the wait
limit, which still bounds a holder with no turns behind it (its first, which may compile).  A peer
stopped while it waited holds the turnstile instead: a waiter that finds the turn free for
``patience_floor_s`` behind a held turnstile goes for the turn without it -- and on later turns, while
the turnstile stays held, after a short try (``TURNSTILE_RETRY_S``: a live waiter there would have
taken the turn and let the turnstile go by then) -- it waited the floor again at every step, and a
decode worker beside a stopped one stepped every 5 s.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import time
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

MIN_POLL_S = 50e-6
MAX_POLL_S = 0.5e-3
WAIT_LIMIT_S = 30.0
PATIENCE_TURNS = 4.0  # a turn is waited for up to this many times its holder's longest recent turn ...
PATIENCE_FLOOR_S = 5.0  # ... and at least this long
RECENT_TURNS = 256  # the longest recent turn: over the last 256 to 512 turns
TURNSTILE_RETRY_S = 4 * MAX_POLL_S  # past a stopped peer's turnstile: how long the next turns try it
# At the lock file's start, written by the turn's holder: when the turn began (time.monotonic(),
# one clock for every process of the host), or minus when it was let go; and the holder's longest
# recent turn in seconds (0.0: none yet).  All zero: not written yet.
TURN_RECORD = struct.Struct("<dd")


class CoreTurns:
    """Turns on ``path`` (created if missing, mode 0600); ``turn()`` holds one around a step.

    ``turns`` counts the turns taken, ``missed`` the steps that ran without one (``wait_limit_s``
    passed, or the holder's turn outlasted the waiter's patience: see the module), ``waited_s`` the
    time spent waiting.
    """

    def __init__(self, path: str | Path, wait_limit_s: float = WAIT_LIMIT_S,
                 patience_floor_s: float = PATIENCE_FLOOR_S):
        if not wait_limit_s > 0:
            raise ValueError(f"core turns: wait_limit_s must be > 0 seconds, got {wait_limit_s}")
        if not patience_floor_s > 0:
            raise ValueError(f"core turns: patience_floor_s must be > 0 seconds, got {patience_floor_s}")
        self.path = Path(path)
        self.wait_limit_s = wait_limit_s
        self.patience_floor_s = patience_floor_s
        self.turns = 0
        self.missed = 0
        self.waited_s = 0.0
        self._stuck = False  # the last turn was missed: do not wait again until the lock is free
        self._past_turnstile = False  # the last turn was taken without the turnstile (its holder is stopped)
        self._longest = self._longest_before = 0.0  # this window's longest turn, and the last window's
        self._window_turns = 0
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
        stuck = False  # the turnstile was given up as held by a stopped peer

        def turnstile_stuck() -> bool:
            nonlocal stuck
            stuck = self._turnstile_stuck()
            return stuck

        # Past a stopped peer's turnstile, a short try only: a live waiter holding it takes the
        # turn this worker just let go within a poll, and lets the turnstile go.
        queue_deadline = min(deadline, began + TURNSTILE_RETRY_S) if self._past_turnstile else deadline
        queued = _lock_by(self._queue, queue_deadline, turnstile_stuck)
        held = _lock_by(self._lock, deadline, self._holder_outlasted)
        if queued:
            fcntl.flock(self._queue, fcntl.LOCK_UN)
        self._past_turnstile = held and not queued and (stuck or self._past_turnstile)
        now = time.monotonic()
        self.waited_s += now - began
        if held:
            self.turns += 1
            self._publish(now)
        else:
            self.missed += 1
            if not self._stuck:
                log.warning("core turns: no turn on %s after %.1f s (its holder's turn has outlasted its usual "
                            "length, or the %.0f s limit passed); steps run beside another worker's until it lets "
                            "go", self.path, now - began, self.wait_limit_s)
        self._stuck = not held
        try:
            yield held
        finally:
            if held:
                let_go = time.monotonic()
                self._note_turn(let_go - now)
                self._publish(-let_go)
                fcntl.flock(self._lock, fcntl.LOCK_UN)

    def _note_turn(self, seconds: float) -> None:
        self._longest = max(self._longest, seconds)
        self._window_turns += 1
        if self._window_turns == RECENT_TURNS:
            self._longest_before, self._longest, self._window_turns = self._longest, 0.0, 0

    def _publish(self, when: float) -> None:
        """The turn's record (``TURN_RECORD``): when it began (minus when it was let go) and the
        longest recent turn."""
        with contextlib.suppress(OSError):
            os.pwrite(self._lock, TURN_RECORD.pack(when, max(self._longest, self._longest_before)), 0)

    def _record(self) -> tuple[float, float]:
        """The lock file's ``TURN_RECORD`` (zeros where there is none)."""
        try:
            record = os.pread(self._lock, TURN_RECORD.size, 0)
        except OSError:
            return 0.0, 0.0
        return TURN_RECORD.unpack(record) if len(record) == TURN_RECORD.size else (0.0, 0.0)

    def _holder_outlasted(self) -> bool:
        """Whether the turn now held has lasted past this waiter's patience (module docstring)."""
        return self._outlasted(*self._record())

    def _outlasted(self, began: float, longest: float) -> bool:
        """``_holder_outlasted`` on a record: False where its holder has no turns behind it, or the
        record is not (yet) one of a held turn."""
        if not (began > 0 and longest > 0):  # let go (or taken, not yet written); no turns yet; NaN
            return False
        return time.monotonic() - began > max(self.patience_floor_s, PATIENCE_TURNS * longest)

    def _turnstile_stuck(self) -> bool:
        """Whether the turn has been free for ``patience_floor_s`` while the turnstile stays held (its
        holder, a waiter, would have taken the turn at once: it is stopped); or the turn is held past
        patience, which the turnstile's holder waits out too."""
        began, longest = self._record()
        let_go = -began
        return (let_go > 0 and time.monotonic() - let_go > self.patience_floor_s) or self._outlasted(began, longest)

    def close(self) -> None:
        for fd in (self._lock, self._queue):
            with contextlib.suppress(OSError):
                os.close(fd)


def _lock_by(fd: int, deadline: float, give_up) -> bool:
    """Lock ``fd`` exclusively, polling with a growing pause; False once ``deadline`` passes or
    ``give_up()`` says so."""
    pause = MIN_POLL_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        now = time.monotonic()
        if now >= deadline or give_up():
            return False
        time.sleep(min(pause, deadline - now))
        pause = min(2 * pause, MAX_POLL_S)
