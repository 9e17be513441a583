"""The last resort for an engine thread that hangs holding the GIL.

The watchdog (``EngineThread``) is a Python thread: a step stuck in native code that never lets go
of the GIL (a C extension spinning, a driver call made with the GIL held) stops it, and the event
loop, and every timer the worker could set.  ``faulthandler``'s later-dump runs on a C thread of
its own, without the GIL: armed around the engine thread's work, it dumps every thread's traceback
to stderr and ends the process with status 1, so the supervisor restarts it.

Arming starts a C thread, so it is not done before every step: while the engine thread stays busy
the timer is renewed only once ``RENEW_FRACTION`` of its bound has passed since it was last set,
and it is cancelled whenever the thread goes idle.  So a step or command that hangs ends the
process no sooner than ``min_s`` after it began, and at most ``min_s / (1 - RENEW_FRACTION)``.
``min_s`` must exceed the watchdog's longest bound by enough for the watchdog to notice first when
it can run: it then fails the worker in order (errors to every stream, out of the registry) and
``disarm`` hands the exit over to the worker's own bounded shutdown.

The timer is process-wide: one engine thread per process may use it (a worker's).
"""
from __future__ import annotations

import faulthandler
import sys
import threading
import time

RENEW_FRACTION = 0.1


class HangBackstop:
    """``arm`` before a step or command, ``disarm`` when idle or once the watchdog has fired."""

    def __init__(self, min_s: float):
        if not min_s > 0:
            raise ValueError(f"min_s must be > 0, got {min_s}")
        self.min_s = min_s
        self.bound_s = min_s / (1 - RENEW_FRACTION)  # what the timer is set to
        self._armed_at: float | None = None
        self._lock = threading.Lock()  # the watchdog thread disarms while the engine thread arms

    def arm(self) -> None:
        with self._lock:
            now = time.monotonic()
            if self._armed_at is not None and now - self._armed_at < RENEW_FRACTION * self.bound_s:
                return
            faulthandler.dump_traceback_later(self.bound_s, exit=True, file=sys.stderr)
            self._armed_at = now

    def disarm(self) -> None:
        with self._lock:
            if self._armed_at is not None:
                faulthandler.cancel_dump_traceback_later()
                self._armed_at = None

    @property
    def armed(self) -> bool:
        return self._armed_at is not None
