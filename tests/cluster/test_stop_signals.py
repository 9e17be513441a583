"""How a launcher counts the signals that stop it (common/cluster/children.py ``StopSignals``): the
first stops, the third kills at once; a SIGTERM echoed within a second (``kill`` of ``make up``'s
process group reaches the launcher, and make passes it on) counts once."""
from __future__ import annotations

import signal

from common.cluster.children import StopSignals


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_sigterm_echoed_within_a_second_is_one_request():
    clock, said = Clock(), []
    signals = StopSignals(said.append, clock)
    signals._on_signal(signal.SIGTERM, None)
    clock.now += 0.01
    signals._on_signal(signal.SIGTERM, None)  # make's copy of the group's
    assert (signals.received, signals.requested, len(said)) == (1, True, 1)
    for _ in range(2):
        clock.now += StopSignals.ECHO_S * 0.6  # a supervisor's, every 0.6 s: the second one counts
        signals._on_signal(signal.SIGTERM, None)
    assert signals.received == 2 and not signals.hurry
    clock.now += StopSignals.ECHO_S + 0.1
    signals._on_signal(signal.SIGTERM, None)
    assert signals.hurry and signals.received == 3


def test_ctrl_c_counts_every_time():
    signals = StopSignals(lambda _: None, Clock())  # (the clock stands still: no SIGINT is an echo)
    for expected in (1, 2, 3):
        signals._on_signal(signal.SIGINT, None)
        assert signals.received == expected
    assert signals.hurry
