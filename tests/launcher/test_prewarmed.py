"""``launcher.prewarmed``: a ``python -m`` command forked from the prewarm server behaves as the
same command started the ordinary way -- arguments, environment, directory, output, its own
session, CPU affinity, thread count, exit status and signals -- with torch already imported."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from common.cluster.children import exit_status, start_child
from launcher.prewarmed import PrewarmedProcess, PrewarmedStarter
from launcher.prewarm_server import HEADER
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow(seconds=31)  # a long file: scheduled by its length (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
PROBE = "tests.support.prewarm_probe"


@pytest.fixture(scope="module")
def starter():
    started = PrewarmedStarter().start()
    try:
        yield started
    finally:
        started.close()


def probe(starter, tmp_path: Path, action: str, env_extra: dict | None = None, cpus=None, spawner=None):
    report = tmp_path / f"report-{time.monotonic_ns()}.json"
    log = tmp_path / f"log-{time.monotonic_ns()}.txt"
    env = {**os.environ, "PROBE_VAR": "given", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    env.pop("PROBE_STRAY", None)
    with log.open("w") as out:
        proc = (spawner or starter)([sys.executable, "-m", PROBE, str(report), action], cpus=cpus, cwd=ROOT,
                                    env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, report, log


def gone(process: psutil.Process) -> bool:
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def read_report(report: Path) -> dict:
    wait_until(report.exists, timeout=120, what="the probe to report")
    return json.loads(report.read_text())


def test_a_forked_command_is_started_as_python_dash_m_would_start_it(starter, tmp_path, monkeypatch):
    monkeypatch.setenv("PROBE_STRAY", "the test process's own")  # not in the child's environment
    proc, report_path, log = probe(starter, tmp_path, "exit 3", cpus=[0])
    assert isinstance(proc, PrewarmedProcess)
    assert proc.wait(120) == 3
    report = read_report(report_path)
    assert report["torch_preloaded"] is True  # the point of it
    assert report["name"] == "__main__"
    assert report["argv"][1:] == [str(report_path), "exit 3"] and report["argv"][0].endswith("prewarm_probe.py")
    assert report["probe_var"] == "given" and report["stray"] is None
    assert report["cwd"] == str(ROOT)
    assert report["pid"] == proc.pid and report["pgid"] == proc.pid and report["sid"] == proc.pid
    assert report["threads"] == 1 and report["affinity"] == [0]
    assert log.read_text().splitlines() == ["to stdout", "to stderr"]


def test_the_thread_count_follows_the_childs_environment(starter, tmp_path):
    proc, report_path, _ = probe(starter, tmp_path, "exit 0", env_extra={"OMP_NUM_THREADS": "2"})
    assert proc.wait(120) == 0
    assert read_report(report_path)["threads"] == 2


def test_an_exception_exits_1_and_its_traceback_goes_to_the_log(starter, tmp_path):
    proc, _, log = probe(starter, tmp_path, "raise")
    assert proc.wait(120) == 1
    assert "RuntimeError: the probe was told to fail" in log.read_text()


def test_signals_and_wait_behave_as_popens(starter, tmp_path):
    proc, report_path, _ = probe(starter, tmp_path, "sleep")
    read_report(report_path)
    assert proc.poll() is None and exit_status(proc) is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.1)
    proc.terminate()
    assert proc.wait(60) == -signal.SIGTERM
    assert proc.poll() == -signal.SIGTERM
    proc.kill()  # after the exit: nothing happens


def test_an_exited_childs_helpers_are_swept_with_its_group(starter, tmp_path):
    proc, report_path, _ = probe(starter, tmp_path, "helper")
    helper = psutil.Process(read_report(report_path)["helper"])
    assert proc.wait(60) == 0
    wait_until(lambda: gone(helper), what="the exited child's helper to be swept", timeout=60)


def test_a_command_that_is_not_python_dash_m_starts_the_ordinary_way(starter):
    proc = starter(["/bin/sh", "-c", "exit 4"], env=dict(os.environ))
    assert isinstance(proc, subprocess.Popen)
    assert proc.wait(60) == 4


def test_closing_the_starter_takes_its_children_down(tmp_path):
    own = PrewarmedStarter().start()
    try:
        proc, report_path, _ = probe(own, tmp_path, "sleep")
        child = psutil.Process(read_report(report_path)["pid"])
    finally:
        own.close()
    assert proc.wait(60) == -signal.SIGKILL  # the server is gone: reported as killed
    wait_until(lambda: gone(child), what="the child to die with its prewarm server", timeout=60)


def test_a_malformed_request_is_refused_and_the_server_goes_on(starter, tmp_path):
    assert probe(starter, tmp_path, "exit 0")[0].wait(120) == 0  # the server is up (its socket made), whatever ran before
    for payload in (b"not json", json.dumps({"module": "x", "args": "not a list", "env": {}, "cwd": "/"}).encode()):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(starter.socket_path)
            socket.send_fds(conn, [HEADER.pack(len(payload)) + payload], [1, 2])
            conn.settimeout(60)
            assert b"error" in conn.recv(4096)
    proc, _, _ = probe(starter, tmp_path, "exit 0")
    assert proc.wait(120) == 0


def test_the_ordinary_way_gives_the_same_report(tmp_path):
    """The reference the prewarmed start is held to: the same probe through ``start_child``."""
    proc, report_path, log = probe(None, tmp_path, "exit 3", cpus=[0], spawner=start_child)
    assert proc.wait(120) == 3
    report = read_report(report_path)
    assert report["torch_preloaded"] is False
    assert report["name"] == "__main__" and report["argv"][0].endswith("prewarm_probe.py")
    assert report["pgid"] == proc.pid and report["threads"] == 1 and report["affinity"] == [0]
    assert log.read_text().splitlines() == ["to stdout", "to stderr"]
