"""The launcher's child processes: bound to its life, each in a process group of its own, stopped together.

``start_child`` starts a command so that

* it leads a new session, so a new process group: the launcher signals the group as a whole (the
  helpers a child starts go with it), and the terminal's Ctrl-C reaches the launcher alone, which
  then stops its children in order instead of each child seeing the signal once from the terminal
  and again from the launcher;
* it is SIGKILLed by the kernel when the launcher dies, however it dies (Linux
  ``PR_SET_PDEATHSIG``): a launcher killed with SIGKILL leaves no gateway holding its port, no
  worker, no private Redis.  The kernel sends that signal when the *thread* that started the
  child ends, so it is set only for children started from the main thread; a child started from
  another thread would die with that thread.  If the launcher died before the child set the
  signal, the child sees a new parent and kills itself.

``stop_all`` sends SIGTERM to every process at once, waits for all of them within one bound (the
longest drain any of them may take, plus a grace to shut down) and SIGKILLs the process groups
still there.  ``StopSignals`` is how a launcher answers SIGINT/SIGTERM/SIGHUP: a first signal asks
for that stop, a second changes nothing, a third kills everything at once.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Iterable

DID_NOT_START = "did not start"  # the exit status of a process whose last start failed


def describe_exit(returncode: int | str) -> str:
    if isinstance(returncode, str):
        return returncode
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_DEATH_SIGNAL = signal.SIGKILL  # nobody is left to bound a graceful drain once the launcher is gone
KILL_WAIT_S = 10.0  # how long a SIGKILLed process may take to be reaped (uninterruptible I/O) before we move on
STOP_POLL_S = 0.05


def _libc_prctl():
    """libc's ``prctl``, looked up once here: after ``fork()`` the child should only call it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _libc_prctl()


def die_with_parent(expected_parent: int | None = None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGKILL the child when this process dies.

    ``expected_parent`` is this process's pid (the default); the child compares it with its parent
    after arming the signal and kills itself when they differ: the parent died before the signal
    was armed.  ``None`` where the signal is not available (not Linux), and where the caller is
    not the main thread (the signal follows the thread that forked the child)."""
    if _PRCTL is None or threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid() if expected_parent is None else expected_parent
    prctl = _PRCTL

    def arm() -> None:
        if prctl(PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), PARENT_DEATH_SIGNAL)

    return arm


def start_child(command: list[str], *, cpus: Iterable[int] | None = None, **popen_kwargs) -> subprocess.Popen:
    """Start ``command`` in a new session (its own process group), to die with this process (see
    the module docstring), pinned to ``cpus`` before exec when given (every thread it starts inherits
    the pinning).  Other keyword arguments go to ``subprocess.Popen``."""
    bind = die_with_parent()
    cpus = list(cpus) if cpus else None

    def before_exec() -> None:
        if bind is not None:
            bind()
        if cpus:
            os.sched_setaffinity(0, cpus)

    needed = bind is not None or cpus
    return subprocess.Popen(command, start_new_session=True, preexec_fn=before_exec if needed else None,
                            **popen_kwargs)


def signal_group(popen: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the process group ``popen`` leads (started by ``start_child``), while its
    leader is not yet reaped; nothing when the group is gone."""
    if popen.returncode is not None:
        return  # reaped: its group id may already belong to someone else
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def exit_status(popen: subprocess.Popen) -> int | None:
    """``popen.poll()``, and once the process has exited, SIGKILL what is left of its process group
    (helpers it started) first, while the unreaped leader still holds the group id."""
    if popen.returncode is not None:
        return popen.returncode
    if not isinstance(popen, subprocess.Popen):  # a process another one reaps (``launcher.prewarmed``)
        return popen.poll()  # and whose group that one sweeps
    if not hasattr(os, "waitid"):  # macOS before Python 3.13: no look without reaping, no sweep
        return popen.poll()
    try:
        exited = os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped meanwhile by a wait() in another thread
        return popen.poll()
    if exited is None:
        return None
    signal_group(popen, signal.SIGKILL)
    return popen.poll()


def stop_all(popens: Iterable[subprocess.Popen | None], bound_s: float,
             hurry: Callable[[], bool] = lambda: False, say: Callable[..., None] = print) -> None:
    """Stop every process at once: SIGTERM to each, then wait for all of them together until
    ``bound_s`` has passed or ``hurry()`` turns true, then SIGKILL the process groups still there.
    ``None`` (a process that never started) and processes that already exited are skipped."""
    live = [p for p in popens if p is not None and exit_status(p) is None]
    for popen in live:
        try:  # not popen.send_signal: it may reap the process, and then its group is not swept
            os.kill(popen.pid, signal.SIGTERM)  # unreaped, so the pid is still this process's
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + bound_s
    while live:
        live = [p for p in live if exit_status(p) is None]
        if not live or time.monotonic() >= deadline or hurry():
            break
        time.sleep(STOP_POLL_S)
    for popen in live:
        signal_group(popen, signal.SIGKILL)
    for popen in live:
        try:
            popen.wait(KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            say(f"process {popen.pid} did not exit {KILL_WAIT_S:g} s after SIGKILL (uninterruptible I/O?)", flush=True)


def _write_stderr(message: str) -> None:
    try:
        os.write(2, (message + "\n").encode())  # unbuffered: safe inside a signal handler
    except OSError:
        pass


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP, as a launcher answers them.

    The first asks for a stop (``requested``): start-up is abandoned where it next checks, a
    running stack is drained.  A second changes nothing (the stop already under way goes on).
    The third sets ``hurry``: whatever is still running is SIGKILLed at once.  The handlers never
    raise: an exception thrown into ``stop()`` half-way would leave processes running.

    A SIGTERM within ``ECHO_S`` of the last one is the same request, not another: ``kill`` of a
    process group reaches the launcher and ``make``, and make passes SIGTERM on to its children
    (not SIGINT: a terminal's Ctrl-C reaches the group once), so one ``kill -TERM -- -PGID`` of
    ``make up`` arrived twice, a step from killing everything.
    """

    HURRY_AFTER = 3
    ECHO_S = 1.0
    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, notify: Callable[[str], None] = _write_stderr, clock: Callable[[], float] = time.monotonic):
        self.received = 0
        self.notify = notify
        self.clock = clock
        self._last_term = -float("inf")

    def install(self) -> "StopSignals":
        for sig in self.SIGNALS:
            signal.signal(sig, self._on_signal)
        return self

    @property
    def requested(self) -> bool:
        return self.received >= 1

    @property
    def hurry(self) -> bool:
        return self.received >= self.HURRY_AFTER

    def _on_signal(self, signum: int, _frame) -> None:
        if signum == signal.SIGTERM:
            now = self.clock()
            if now - self._last_term < self.ECHO_S:
                return
            self._last_term = now  # (an echo does not move the window: SIGTERMs every half second all count)
        self.received += 1
        name = signal.Signals(signum).name
        if self.received == 1:
            self.notify(f"{name}: stopping (processes drain; signal twice more to kill them at once)")
        elif self.received < self.HURRY_AFTER:
            self.notify(f"{name}: already stopping; once more kills every process at once")
        elif self.received == self.HURRY_AFTER:
            self.notify(f"{name}: killing every process now")
