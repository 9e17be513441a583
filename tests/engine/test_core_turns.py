"""Core turns (common/engine/core_turns.py): steps of workers that share the cores never overlap,
a worker that comes back while another waits goes after it, a turn held too long is not waited for
(past the wait limit, or far past its holder's usual turn), and a holder that dies frees the turn."""
import fcntl
import os
import subprocess
import sys
import threading
import time

import pytest

from common.engine.core_turns import RECENT_TURNS, CoreTurns

WAIT = 60.0


@pytest.fixture
def lock_path(tmp_path):
    return tmp_path / "turns.lock"


def test_turns_never_overlap(lock_path):
    """Two workers (one CoreTurns each, as two processes hold them) take 200 turns each: at most
    one is ever inside, and every turn is a turn (none missed)."""
    inside, overlaps, turns = [0], [], [CoreTurns(lock_path), CoreTurns(lock_path)]
    guard = threading.Lock()

    def worker(turn):
        for _ in range(200):
            with turn.turn() as held:
                assert held
                with guard:
                    inside[0] += 1
                    overlaps.append(inside[0])
                with guard:
                    inside[0] -= 1

    threads = [threading.Thread(target=worker, args=(t,)) for t in turns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert max(overlaps) == 1 and len(overlaps) == 400
    assert [t.turns for t in turns] == [200, 200] and [t.missed for t in turns] == [0, 0]


def test_a_worker_that_comes_back_goes_after_the_one_waiting(lock_path):
    """A holds a turn; B queues for the next; A lets go and at once asks again: B's turn comes
    first (without the turnstile A could take the lock straight back, and B would starve)."""
    a, b, probe = CoreTurns(lock_path), CoreTurns(lock_path), os.open(f"{lock_path}.queue", os.O_RDWR)
    order, b_in = [], threading.Event()

    def b_turn():
        with b.turn():
            b_in.set()
            order.append("b")

    with a.turn():
        order.append("a")
        waiter = threading.Thread(target=b_turn)
        waiter.start()
        assert until(lambda: queue_held(probe)), "B never queued for the next turn"
    with a.turn():
        assert b_in.is_set()  # B's turn began before this one
        order.append("a")
    waiter.join(WAIT)
    assert order == ["a", "b", "a"]
    os.close(probe)


def queue_held(fd) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def until(condition, limit=WAIT) -> bool:
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def test_a_turn_held_too_long_is_not_waited_for(lock_path):
    """Past the wait limit the step runs without its turn; while the lock stays taken the next
    steps do not wait again (a hung peer costs one wait); once it is free, turns resume."""
    holder = os.open(lock_path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)  # a peer hung inside its step
    turns = CoreTurns(lock_path, wait_limit_s=0.2)
    with turns.turn() as held:
        assert not held
    assert turns.missed == 1 and turns.turns == 0
    turns.wait_limit_s = WAIT
    with turns.turn() as held:
        assert not held
    assert turns.missed == 2 and turns.waited_s < WAIT / 2  # no second wait of the limit
    fcntl.flock(holder, fcntl.LOCK_UN)
    with turns.turn() as held:
        assert held
    os.close(holder)


def _hold_a_turn(turns: CoreTurns):
    """A thread holding a turn of ``turns`` (a peer stopped inside its step) until the event is set."""
    inside, release = threading.Event(), threading.Event()

    def hold():
        with turns.turn() as held:
            assert held
            inside.set()
            release.wait(WAIT)

    thread = threading.Thread(target=hold)
    thread.start()
    assert inside.wait(WAIT)
    return thread, release


def _turn_in_thread(turns: CoreTurns) -> list:
    """``turns.turn()``'s answer from another thread, once it has one (an empty list: none within WAIT)."""
    got = []

    def take():
        with turns.turn() as held:
            got.append(held)

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    thread.join(WAIT)
    return got


def _waited_for(peer: CoreTurns, waiter: CoreTurns, hold_s: float) -> list:
    """The peer holds a turn for ``hold_s`` while the waiter asks for one: ``turn()``'s answer to it."""
    thread, release = _hold_a_turn(peer)
    got = []
    try:
        taker = threading.Thread(target=lambda: got.extend(_turn_in_thread(waiter)))
        taker.start()
        time.sleep(hold_s)
    finally:
        release.set()
        thread.join(WAIT)
    taker.join(WAIT)
    return got


def test_a_turn_held_far_past_its_holders_usual_is_not_waited_for(lock_path):
    """A peer whose turns are short (a few quick ones behind it) holds one and stops (SIGSTOP, a hang):
    a waiter gives up once the turn has lasted PATIENCE_TURNS x its longest recent one (and the
    floor), not after the hour-long wait limit -- and steps after it do not wait while it stays held."""
    peer = CoreTurns(lock_path)
    for _ in range(5):
        with peer.turn() as held:
            assert held
    thread, release = _hold_a_turn(peer)
    try:
        waiter = CoreTurns(lock_path, wait_limit_s=3600, patience_floor_s=0.05)
        assert _turn_in_thread(waiter) == [False]  # (an empty list: still waiting after WAIT s)
        assert waiter.missed == 1 and waiter.waited_s < WAIT
    finally:
        release.set()
        thread.join(WAIT)
    assert _turn_in_thread(waiter) == [True]  # let go: turns resume


def test_a_holder_with_no_turns_behind_it_is_waited_for_to_the_limit(lock_path):
    """Its first turn (which may compile for long) has no usual length to outlast: only the wait limit
    ends the wait, however short the waiter's patience."""
    peer = CoreTurns(lock_path)
    thread, release = _hold_a_turn(peer)
    try:
        waiter = CoreTurns(lock_path, wait_limit_s=0.5, patience_floor_s=0.001)
        assert _turn_in_thread(waiter) == [False]
        assert waiter.waited_s >= 0.5
    finally:
        release.set()
        thread.join(WAIT)


@pytest.mark.parametrize("quick_turns", [3, RECENT_TURNS])  # within its window; past it (the last window's)
def test_a_turn_within_its_holders_usual_length_is_waited_for(lock_path, quick_turns):
    """A peer whose longest recent turn is long (one of 0.5 s, then quick ones) takes one twice that:
    the waiter, with a patience floor far below it, waits for it (PATIENCE_TURNS x 0.5 s) rather than
    running beside it."""
    peer = CoreTurns(lock_path)
    with peer.turn():
        time.sleep(0.5)
    for _ in range(quick_turns):
        with peer.turn():
            pass
    waiter = CoreTurns(lock_path, wait_limit_s=3600, patience_floor_s=0.001)
    # the peer's turn: twice its longest, half the waiter's patience
    assert _waited_for(peer, waiter, hold_s=1.0) == [True] and waiter.missed == 0


def test_a_turn_longer_than_its_holders_quick_ones_is_waited_for_up_to_the_floor(lock_path):
    """A peer whose turns so far were instants (decode steps of nothing) takes a longer one (a prompt
    chunk): the patience floor, not PATIENCE_TURNS x an instant, bounds the wait."""
    peer = CoreTurns(lock_path)
    for _ in range(5):
        with peer.turn():
            pass
    waiter = CoreTurns(lock_path, wait_limit_s=3600, patience_floor_s=5.0)
    # thousands of the peer's usual turns, a fraction of the floor
    assert _waited_for(peer, waiter, hold_s=0.3) == [True] and waiter.missed == 0


def test_a_peer_stopped_while_it_waited_in_the_turnstile_does_not_hold_the_others_back(lock_path):
    """The turn is free, but a peer stopped while queued for it holds the turnstile: once the turn has
    been free for the patience floor, a waiter takes it without the turnstile."""
    peer = CoreTurns(lock_path)
    with peer.turn():
        pass
    queued = os.open(f"{lock_path}.queue", os.O_RDWR)
    fcntl.flock(queued, fcntl.LOCK_EX)  # the stopped peer's place in the turnstile
    try:
        waiter = CoreTurns(lock_path, wait_limit_s=5.0, patience_floor_s=0.05)
        assert _turn_in_thread(waiter) == [True] and waiter.missed == 0
        # While the turnstile stays held, the next turns go past it after a short try: the floor
        # was waited again at every step (its own last turn's end restarts it) -- here, where the
        # turn's record never says stuck, the whole wait limit.
        waiter._turnstile_stuck = lambda: False
        for _ in range(3):
            waited = waiter.waited_s
            assert _turn_in_thread(waiter) == [True]
            assert waiter.waited_s - waited < waiter.wait_limit_s
        assert waiter.missed == 0
    finally:
        os.close(queued)
    assert _turn_in_thread(waiter) == [True] and not waiter._past_turnstile  # the turnstile free again: used


def test_a_holder_that_dies_frees_the_turn(lock_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         f"fd = os.open({str(lock_path)!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        turns = CoreTurns(lock_path, wait_limit_s=WAIT)
        holder.kill()
        with turns.turn() as held:
            assert held and turns.missed == 0
    finally:
        holder.kill()
        holder.wait()


def test_the_wait_limit_must_be_positive(lock_path):
    with pytest.raises(ValueError, match="wait_limit_s"):
        CoreTurns(lock_path, wait_limit_s=0)



def test_the_patience_floor_must_be_positive(lock_path):
    with pytest.raises(ValueError, match="patience_floor_s"):
        CoreTurns(lock_path, patience_floor_s=0)
