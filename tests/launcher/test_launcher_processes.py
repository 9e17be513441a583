"""The launcher's processes with real (tiny) children: none outlives the launcher, however it ends;
stop() drains all of them at once within one bound; a second Ctrl-C changes nothing, a third kills
at once; a process that never started does not break stop().

``tests/support/launcher_parent.py`` is a launcher (``run_stack``, a private Redis) over
``tests/support/launcher_child.py`` children, which record when SIGTERM reached them and drain until the
test releases them.  Nothing here bets on timing: every step waits for the state it needs.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from common.cluster.children import die_with_parent, start_child
from launcher.local_stack import ROOT, LocalStack

WAIT = 120.0  # generous: processes start and stop on two shared cores
SUPPORT = Path(__file__).resolve().parents[1] / "support"
CHILD = str(SUPPORT / "launcher_child.py")
PARENT = str(SUPPORT / "launcher_parent.py")


def wait_for(predicate, what: str, timeout: float = WAIT):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def gone(proc: psutil.Process) -> bool:
    """Dead: no such process any more, or a zombie nobody has reaped yet."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class Parent:
    """A running ``tests/support/launcher_parent.py`` and the processes it started."""

    def __init__(self, directory: Path, mode: str, count: int = 3):
        self.directory = directory
        self.log_path = directory / "parent.log"
        with self.log_path.open("w") as log:
            # Bound to this test process too, so a failing test leaves nothing behind.
            self.popen = start_child([sys.executable, PARENT, str(directory), mode, str(count)], cwd=ROOT,
                                     stdout=log, stderr=subprocess.STDOUT)
        info = json.loads(wait_for(self._info, "the launcher to start its children"))
        self.children = {name: psutil.Process(pid) for name, pid in info["children"].items()}
        self.redis = psutil.Process(info["redis"])

    def _info(self) -> str | None:
        assert self.popen.poll() is None, self.log()
        path = self.directory / "parent.json"
        return path.read_text() if path.exists() else None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def everything(self) -> list[psutil.Process]:
        return [*self.children.values(), self.redis]

    def all_terminated(self) -> bool:
        return all((self.directory / f"{name}.term").exists() for name in self.children)

    def signal_and_wait_for(self, sig: int, text: str) -> None:
        """Send ``sig`` and wait until the launcher says ``text`` (its handler ran), or it exited."""
        count = self.log().count(text)
        self.popen.send_signal(sig)
        wait_for(lambda: self.log().count(text) > count or self.popen.poll() is not None, f"{text!r} in the log")

    def cleanup(self) -> None:
        for proc in [*self.everything()]:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


def test_a_sigkilled_launcher_takes_its_children_and_its_private_redis_with_it(tmp_path):
    parent = Parent(tmp_path, "stuck")
    try:
        assert not any(gone(p) for p in parent.everything())
        parent.popen.kill()
        assert parent.popen.wait(WAIT) == -signal.SIGKILL
        for proc in parent.everything():
            wait_for(lambda: gone(proc), f"{proc.pid} to die with its launcher")
    finally:
        parent.cleanup()


def test_a_second_sigint_during_startup_cleanup_does_not_cut_the_stop_short(tmp_path):
    """Ctrl-C while the stack is still starting: every process gets SIGTERM and drains; a second
    Ctrl-C meanwhile changes nothing.  The launcher waits for every drain, then stops its Redis."""
    parent = Parent(tmp_path, "drain")
    try:
        parent.popen.send_signal(signal.SIGINT)
        wait_for(parent.all_terminated, "every child to get SIGTERM")
        parent.signal_and_wait_for(signal.SIGINT, "already stopping")
        assert parent.popen.poll() is None, f"the launcher gave up its stop half-way:\n{parent.log()}"
        assert not any(gone(p) for p in parent.children.values()), "a draining child was killed"

        (tmp_path / "release").write_text("")  # the drains end
        assert parent.popen.wait(WAIT) == 3, parent.log()
        assert all((tmp_path / f"{name}.drained").exists() for name in parent.children), parent.log()
        for proc in parent.everything():
            wait_for(lambda: gone(proc), f"{proc.pid} to be gone")
    finally:
        parent.cleanup()


def test_a_third_sigint_kills_every_process_at_once(tmp_path):
    """Children that never finish draining (they ignore SIGTERM, and may take an hour): the third
    Ctrl-C SIGKILLs them and the launcher exits."""
    parent = Parent(tmp_path, "stuck")
    try:
        parent.popen.send_signal(signal.SIGINT)
        wait_for(parent.all_terminated, "every child to get SIGTERM")
        parent.signal_and_wait_for(signal.SIGINT, "already stopping")
        assert parent.popen.poll() is None and not any(gone(p) for p in parent.everything()), parent.log()
        parent.popen.send_signal(signal.SIGINT)
        assert parent.popen.wait(WAIT) == 3, parent.log()
        for proc in parent.everything():
            wait_for(lambda: gone(proc), f"{proc.pid} to be gone")
        assert not any((tmp_path / f"{name}.drained").exists() for name in parent.children)
    finally:
        parent.cleanup()


def test_stop_drains_every_process_at_once_and_kills_the_stuck_ones_at_one_bound(tmp_path):
    """Two children drain until released, two ignore SIGTERM.  Every child gets SIGTERM before
    any is waited for; the drained ones exit 0; the stuck ones are SIGKILLed together at the one
    bound, not one bound after the other (each holds a FIFO open: its reader sees the death)."""
    stack = LocalStack("unused", "redis://unused", workdir=tmp_path, stop_grace_s=4.0)
    died: dict[str, float] = {}
    readers = []
    for name in ("stuck0", "stuck1"):
        fifo = tmp_path / f"{name}.fifo"
        os.mkfifo(fifo)

        def read_until_death(path=fifo, name=name):
            with open(path, "rb") as f:
                f.read()
            died[name] = time.monotonic()

        readers.append(threading.Thread(target=read_until_death, daemon=True))
        readers[-1].start()
    try:
        for name in ("drain0", "drain1"):
            stack.spawn(name, [sys.executable, CHILD, str(tmp_path), name, "drain"])
        for name in ("stuck0", "stuck1"):
            stack.spawn(name, [sys.executable, CHILD, str(tmp_path), name, "stuck", "--fifo",
                               str(tmp_path / f"{name}.fifo")])
        wait_for(lambda: all((tmp_path / f"{n}.ready").exists() for n in stack.procs), "the children to be ready")

        def release_once_all_terminated():
            wait_for(lambda: all((tmp_path / f"{n}.term").exists() for n in stack.procs), "SIGTERM everywhere")
            (tmp_path / "release").write_text("")

        releaser = threading.Thread(target=release_once_all_terminated, daemon=True)
        releaser.start()
        stack.stop()
        releaser.join(WAIT)
        for reader in readers:
            reader.join(WAIT)

        codes = {name: proc.popen.returncode for name, proc in stack.procs.items()}
        assert codes == {"drain0": 0, "drain1": 0, "stuck0": -signal.SIGKILL, "stuck1": -signal.SIGKILL}
        assert abs(died["stuck0"] - died["stuck1"]) < stack.stop_bound() / 2, died
    finally:
        for proc in stack.procs.values():
            if proc.popen is not None and proc.popen.poll() is None:
                proc.popen.kill()
                proc.popen.wait()


def test_stop_covers_the_workers_drain_timeout_as_the_workers_read_it(tmp_path, monkeypatch):
    """The stop bound is the longest drain a worker of the stack was started with (its own
    ``--drain-timeout`` flag, ``PDSERVE_DRAIN_TIMEOUT``, or the worker's default), plus the grace."""
    from worker.config import build_parser  # imports torch: only for this test

    monkeypatch.setattr(LocalStack, "_launch", lambda self, proc: None)  # the bookkeeping, without a model
    default = build_parser("decode", "pdserve worker", {}).get_default("drain_timeout")

    stack = LocalStack("unused", "redis://unused", workdir=tmp_path, stop_grace_s=1.0)
    stack.start_worker("d0", "decode")
    assert stack.stop_bound() == default + 1.0

    stack = LocalStack("unused", "redis://unused", workdir=tmp_path, stop_grace_s=1.0,
                       extra_env={"PDSERVE_DRAIN_TIMEOUT": str(default + 45)})
    stack.start_worker("d0", "decode")
    stack.start_gateway()
    assert stack.stop_bound() == default + 45 + 1.0

    stack = LocalStack("unused", "redis://unused", workdir=tmp_path, stop_grace_s=1.0,
                       role_args={"prefill": ["--drain-timeout", "7"]})
    stack.start_worker("p0", "prefill")
    assert stack.stop_bound() == 7 + 1.0


def test_a_process_that_never_started_does_not_break_stop(tmp_path):
    stack = LocalStack("unused", "redis://unused", workdir=tmp_path)
    stack._spawn("steady", "http.server", ["--bind", "127.0.0.1", "0"], port=0)
    stack.cpus = {"never": [1 << 20]}  # no such CPU: the start fails before exec
    with pytest.raises(subprocess.SubprocessError):
        stack._spawn("never", "platform", [], port=0)
    try:
        assert "never" in stack.procs and not stack.procs["never"].alive
        stack.stop()
        assert stack.procs["steady"].popen.returncode is not None
    finally:
        steady = stack.procs["steady"].popen
        if steady.poll() is None:
            steady.kill()
            steady.wait()


def test_a_process_group_goes_as_a_whole(tmp_path):
    """What a child started itself goes with it: when the launcher kills the child, and when the
    child exits on its own."""
    stack = LocalStack("unused", "redis://unused", workdir=tmp_path)
    helpers = []
    try:
        for name, mode in (("killed", "stuck"), ("exits", "drain")):
            stack._spawn(name, "tests.support.launcher_child", [str(tmp_path), name, mode, "--grandchild"], port=0)
            helpers.append(psutil.Process(int(wait_for(
                lambda: (tmp_path / f"{name}.grandchild").exists() and (tmp_path / f"{name}.ready").exists()
                and (tmp_path / f"{name}.grandchild").read_text(), f"{name}'s helper"))))
        stack.kill("killed")
        wait_for(lambda: gone(helpers[0]), "the killed child's helper to die")

        (tmp_path / "release").write_text("")
        os.kill(stack.procs["exits"].popen.pid, signal.SIGTERM)  # it drains and exits 0 by itself
        wait_for(lambda: not stack.procs["exits"].alive, "the child to exit")
        wait_for(lambda: gone(helpers[1]), "the exited child's helper to die")
    finally:
        stack.stop()
        for helper in helpers:
            try:
                helper.kill()
            except psutil.NoSuchProcess:
                pass


def test_a_child_whose_launcher_died_before_it_was_bound_kills_itself():
    """The race PR_SET_PDEATHSIG leaves open: the parent dies between fork and prctl.  The child
    then has another parent than the one it was started by, and kills itself."""
    not_my_parent = os.getppid()  # alive, and not this process
    popen = subprocess.Popen(["sleep", "600"], preexec_fn=die_with_parent(expected_parent=not_my_parent))
    try:
        assert popen.wait(WAIT) == -signal.SIGKILL
    finally:
        if popen.poll() is None:
            popen.kill()
            popen.wait()


def test_the_parent_death_signal_is_armed_only_from_the_main_thread():
    """Linux sends it when the thread that started the child ends: from a helper thread it would
    kill the child when that thread finishes, so it is not armed there."""
    found = []
    thread = threading.Thread(target=lambda: found.append(die_with_parent()))
    thread.start()
    thread.join()
    assert found == [None]
    assert callable(die_with_parent()) == sys.platform.startswith("linux")
