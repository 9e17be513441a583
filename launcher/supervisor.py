"""Keeping a local stack running: restart what exits, with backoff, and give up a crash loop."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from common.cluster.children import DID_NOT_START, describe_exit

if TYPE_CHECKING:
    from launcher.local_stack import LocalStack
    from common.cluster.redis_util import RedisServer

class Supervisor:
    """Keeps a ``LocalStack`` (and the private Redis it may use) running until told to stop.

    A process that exits (killed, crashed, a worker whose engine failed, or a start that failed)
    is started again with the same command line after a backoff.  A run is *short* when the
    process exited less than ``stable_after`` seconds after its last start (the time it waited to
    be restarted does not count); the backoff is ``min_backoff`` seconds, doubling with each short
    run in a row, up to ``max_backoff``; a run that was not short starts from ``min_backoff`` again.
    The other processes keep serving meanwhile.

    A crash loop ends: after ``crash_loop_limit`` short runs in a row a process is given up (named
    in ``given_up``, not started again).  A worker given up leaves the rest serving; the gateway
    or the private Redis given up makes ``failed`` true, since nothing can serve without them, and
    ``run()`` returns.  Call ``poll()`` periodically (``run()`` does), from the thread that owns the
    stack.  ``clock`` (default: the stack's) measures uptimes and backoffs.
    """

    ESSENTIAL = ("gateway", "redis")

    def __init__(self, stack: "LocalStack", redis_server: "RedisServer | None" = None, *, min_backoff: float = 1.0,
                 max_backoff: float = 30.0, stable_after: float = 60.0, crash_loop_limit: int = 10, say=print,
                 clock: Callable[[], float] | None = None):
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
        self.clock = clock or getattr(stack, "clock", time.monotonic)
        self.restarts: dict[str, int] = {}
        self.given_up: set[str] = set()
        self._short_runs: dict[str, int] = {}  # short runs in a row, the last exit included
        self._due: dict[str, float] = {}  # name -> when to start it again (an exit seen, not yet acted on)
        self._redis_started = self.clock()

    @property
    def failed(self) -> bool:
        """True once the gateway or the private Redis was given up: the stack cannot serve."""
        return any(name in self.given_up for name in self.ESSENTIAL)

    def backoff(self, name: str) -> float:
        """The wait before the next start of ``name``, after the exit last seen."""
        return min(self.max_backoff, self.min_backoff * 2 ** max(0, self._short_runs.get(name, 0) - 1))

    def poll(self, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        if self.redis_server is not None:
            proc = self.redis_server.proc
            self._watch("redis", DID_NOT_START if proc is None else proc.poll(), self._redis_started, now)
        for name, proc in list(self.stack.procs.items()):
            self._watch(name, proc.exit_status(), proc.started_at, now)

    def _watch(self, name: str, returncode: int | str | None, started_at: float, now: float) -> None:
        if returncode is None:  # running (perhaps started again by someone else: nothing left to do)
            self._due.pop(name, None)
            return
        if name in self.given_up:
            return
        due = self._due.get(name)
        if due is None:
            self._exited(name, returncode, uptime=now - started_at, now=now)
        elif now >= due:
            self._restart(name, now)

    def _exited(self, name: str, returncode: int | str, uptime: float, now: float) -> None:
        """An exit seen for the first time: classify the run it ended, then give up or schedule a restart."""
        short = uptime < self.stable_after
        self._short_runs[name] = self._short_runs.get(name, 0) + 1 if short else 0
        if self._short_runs[name] >= self.crash_loop_limit:
            self.given_up.add(name)
            self.say(f"{name} stopped ({describe_exit(returncode)}) {self.crash_loop_limit} times in a row "
                     f"within {self.stable_after:g} s of starting; not restarting it (crash loop)"
                     + ("" if name not in self.ESSENTIAL else "; the stack cannot serve without it"), flush=True)
            return
        delay = self.backoff(name)
        self._due[name] = now + delay
        self.say(f"{name} stopped ({describe_exit(returncode)}) after {uptime:.1f} s; restarting it in {delay:.2f} s",
                 flush=True)

    def _restart(self, name: str, now: float) -> None:
        del self._due[name]
        self.restarts[name] = self.restarts.get(name, 0) + 1
        try:
            if name == "redis":
                self._redis_started = now  # a start that fails is a run of no length
                self.redis_server.start()
            else:
                self.stack.restart(name)
        except Exception as exc:  # e.g. the port is taken: seen as an exit at the next poll
            self.say(f"could not restart {name}: {exc}", flush=True)
            return
        self.say(f"{name} restarted (restart #{self.restarts[name]})", flush=True)

    def run(self, should_stop, interval: float = 0.2) -> None:
        """Supervise until ``should_stop()`` is true (or the stack ``failed``)."""
        while not should_stop() and not self.failed:
            self.poll()
            time.sleep(interval)
