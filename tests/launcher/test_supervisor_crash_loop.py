"""Crash loops are measured by uptime since the last start: the wait for a restart is not uptime.

The supervisor's logic runs here against a scripted stack on a test clock (each run of the
process lasts a chosen time), and once against a real process whose uptime the test sets by
choosing when the supervisor looks (``poll(now=...)``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import example, given, settings
from hypothesis import strategies as st

from launcher.local_stack import LocalStack
from launcher.supervisor import Supervisor

TICK = 0.25  # the test clock's step; every uptime and backoff below is a multiple of it


@dataclass
class ScriptedProc:
    """A stand-in for a stack process: its n-th run lasts ``uptimes[n]`` on the test clock; once
    the script is used up it keeps running."""

    clock: "ManualClock"
    uptimes: list[float]
    runs: int = 0
    started_at: float = 0.0
    starts: list[float] = field(default_factory=lambda: [0.0])

    def exit_status(self) -> int | None:
        if self.runs < len(self.uptimes) and self.clock.now >= self.started_at + self.uptimes[self.runs]:
            return 1
        return None

    @property
    def popen(self) -> "ScriptedProc":  # the same, seen as a Popen (poll)
        return self

    def poll(self) -> int | None:
        return self.exit_status()


@dataclass
class ManualClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


class ScriptedStack:
    """A stack of one scripted process, ``w``."""

    def __init__(self, uptimes: list[float]):
        self.clock = ManualClock()
        self.procs = {"w": ScriptedProc(self.clock, uptimes)}

    def restart(self, name: str) -> None:
        proc = self.procs[name]
        proc.runs += 1
        proc.started_at = self.clock.now
        proc.starts.append(self.clock.now)


def supervise(uptimes: list[float], **options) -> tuple[ScriptedStack, Supervisor]:
    """Run the supervisor over the whole script, polling at every tick."""
    stack = ScriptedStack(uptimes)
    supervisor = Supervisor(stack, say=lambda *_, **__: None, **options)  # its clock: the stack's
    horizon = sum(uptimes) + (len(uptimes) + 1) * supervisor.max_backoff + 1
    while stack.clock.now <= horizon:
        supervisor.poll(now=stack.clock.now)
        stack.clock.now += TICK
    return stack, supervisor


def expected_history(uptimes: list[float], min_backoff: float, max_backoff: float, stable_after: float,
                     limit: int) -> tuple[list[float], bool]:
    """The start times and whether the process is given up, from the rules in ``Supervisor``'s docstring."""
    starts, short_runs, now = [0.0], 0, 0.0
    for uptime in uptimes:
        now += uptime
        short_runs = short_runs + 1 if uptime < stable_after else 0
        if short_runs >= limit:
            return starts, True
        now += min(max_backoff, min_backoff * 2 ** max(0, short_runs - 1))
        starts.append(now)
    return starts, False


def test_a_process_that_crashes_35_s_after_each_start_is_given_up():
    """The example of the finding: a crash 35 s after each start, 60 s to count as stable, the
    backoff growing to 30 s: 35 s + the backoff exceeds 60 s, yet every run was short."""
    stack, supervisor = supervise([35.0] * 30, min_backoff=1.0, max_backoff=30.0, stable_after=60.0,
                                  crash_loop_limit=10)
    assert supervisor.given_up == {"w"}
    assert stack.procs["w"].runs == 9  # ten runs, nine restarts
    assert supervisor.restarts == {"w": 9}


# A tick to 6 s (stable_after: 1, 2 or 4 s); at least a tick, so an exit is seen at the poll after its start.
uptime = st.integers(1, 24).map(lambda n: n * TICK)


@settings(max_examples=150, deadline=None)
@given(uptimes=st.lists(uptime, max_size=14), min_ticks=st.sampled_from([1, 2, 4]), doublings=st.integers(0, 4),
       stable_after=st.sampled_from([1.0, 2.0, 4.0]), limit=st.integers(1, 5))
@example(uptimes=[3.0] * 8, min_ticks=4, doublings=2, stable_after=4.0, limit=4)  # 3 s + a 4 s backoff > 4 s
def test_starts_and_giving_up_follow_the_uptime_since_the_last_start(uptimes, min_ticks, doublings, stable_after,
                                                                     limit):
    """For any script of run lengths: each restart comes exactly one backoff after the exit (the
    backoff doubling with each short run in a row, capped), and the process is given up exactly
    when ``limit`` runs in a row were shorter than ``stable_after``."""
    min_backoff = min_ticks * TICK
    max_backoff = min_backoff * 2 ** doublings
    stack, supervisor = supervise(uptimes, min_backoff=min_backoff, max_backoff=max_backoff,
                                  stable_after=stable_after, crash_loop_limit=limit)
    starts, given_up = expected_history(uptimes, min_backoff, max_backoff, stable_after, limit)
    assert stack.procs["w"].starts == starts
    assert (supervisor.given_up == {"w"}) == given_up


def test_a_real_process_that_ran_35_s_each_time_is_given_up(tmp_path):
    """A real process (it exits at once); the supervisor looks 35 s after each start, and restarts
    it one backoff later: 35 s + 30 s of backoff is past the 60 s, the run was still short."""
    stack = LocalStack("unused", "redis://unused", workdir=tmp_path)
    proc = stack._spawn("flaky", "platform", [], port=0)
    supervisor = Supervisor(stack, min_backoff=30.0, max_backoff=30.0, stable_after=60.0, crash_loop_limit=3,
                            say=lambda *_, **__: None)
    try:
        for _ in range(10):
            proc.popen.wait(120)
            seen_at = proc.started_at + 35.0
            supervisor.poll(now=seen_at)  # the exit, 35 s after the start
            if "flaky" in supervisor.given_up:
                break
            supervisor.poll(now=seen_at + supervisor.backoff("flaky"))  # the restart
        assert supervisor.given_up == {"flaky"}
        assert supervisor.restarts == {"flaky": 2}  # three runs
    finally:
        stack.stop()


def test_a_process_that_cannot_be_started_again_is_given_up(tmp_path):
    """A start that fails (here: pinned to a CPU that does not exist) is a run of no length, so
    a process that can no longer be started ends as a crash loop instead of being retried forever."""
    clock = ManualClock(1000.0)
    stack = LocalStack("unused", "redis://unused", workdir=tmp_path, clock=clock)
    proc = stack._spawn("flaky", "platform", [], port=0)
    stack.cpus = {"flaky": [1 << 20]}  # every later start fails before exec
    supervisor = Supervisor(stack, min_backoff=30.0, max_backoff=30.0, stable_after=60.0, crash_loop_limit=3,
                            say=lambda *_, **__: None)
    try:
        proc.popen.wait(120)
        clock.now += 35.0
        for _ in range(10):
            supervisor.poll()  # an exit, or a failed start, is seen
            if "flaky" in supervisor.given_up:
                break
            clock.now += supervisor.backoff("flaky")
            supervisor.poll()  # the restart, which fails
        assert supervisor.given_up == {"flaky"}
        assert supervisor.restarts == {"flaky": 2}  # one run, two starts that failed
        assert proc.popen is None
    finally:
        stack.stop()
