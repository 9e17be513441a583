"""The OpenMP wait setting (brief spinning, then sleep, unless the environment says otherwise) and one
computing thread per process (a thread that has computed ends its team)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common.engine import openmp_wait

NAMES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


@pytest.fixture
def clean_env(monkeypatch):
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults_are_a_bounded_spin_then_sleep(clean_env):
    openmp_wait.configure()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert os.environ["GOMP_SPINCOUNT"] == str(openmp_wait.SPIN_COUNT)


def test_an_active_policy_from_the_environment_keeps_spinning_unbounded(clean_env):
    clean_env.setenv("OMP_WAIT_POLICY", "ACTIVE")
    openmp_wait.configure()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert "GOMP_SPINCOUNT" not in os.environ  # libgomp's own count for ACTIVE


def test_a_spin_count_from_the_environment_wins(clean_env):
    clean_env.setenv("GOMP_SPINCOUNT", "0")
    openmp_wait.configure()
    assert os.environ["GOMP_SPINCOUNT"] == "0"
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


def test_the_worker_entry_point_sets_it_before_torch_loads():
    env = {k: v for k, v in os.environ.items() if k not in NAMES}
    probe = ("import os, worker.main; "
             "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    assert out == ["PASSIVE", str(openmp_wait.SPIN_COUNT)]


# ---- one computing thread: a thread that has computed lets its OpenMP team go ---------------------
# Each probe runs in a fresh interpreter with two OpenMP threads, so its thread counts see nothing
# of this process's threads and teams.  ``PARALLEL_OP`` is large enough for torch to run it as a
# parallel region (a team of OMP_NUM_THREADS - 1 parked threads for the calling thread).

PARALLEL_OP = "torch.ones(1 << 22).add_(1)"
THREADS = "len(os.listdir('/proc/self/task'))"


def _probe(body: str) -> list[str]:
    env = dict(os.environ, OMP_NUM_THREADS="2")
    script = "import os, threading, torch\nfrom common.engine import openmp_wait\n" + body
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                          check=True).stdout.split()


def test_releasing_a_thread_team_lets_its_threads_go_and_a_later_region_starts_one():
    out = _probe(f"""
counts = []
def compute():
    {PARALLEL_OP}
    counts.append({THREADS})
    counts.append(openmp_wait.release_thread_team())
    counts.append({THREADS})
    {PARALLEL_OP}
    counts.append({THREADS})
thread = threading.Thread(target=compute)
thread.start()
thread.join()
print(*counts)
""")
    with_team, released, without, again = out
    assert released == "True"
    assert int(without) == int(with_team) - 1  # the team's one parked thread is gone
    assert int(again) == int(with_team)


def test_the_worker_builds_its_engine_and_then_ends_the_building_threads_team():
    """``worker.lifecycle.build_engine`` in an executor thread: what the engine computes while it is
    built leaves no team behind (a second release finds nothing to end), also when building fails."""
    out = _probe(f"""
import worker.lifecycle as lifecycle
def computing_engine(config, load_tokenizer):
    {PARALLEL_OP}
    if config == "fail":
        raise RuntimeError("the build failed")
    return "engine"
lifecycle.Engine = computing_engine
counts = []
def build(config):
    try:
        lifecycle.build_engine(config)
    except RuntimeError:
        pass
    counts.append({THREADS})
    openmp_wait.release_thread_team()
    counts.append({THREADS})
for config in ("ok", "fail"):
    thread = threading.Thread(target=build, args=(config,))
    thread.start()
    thread.join()
print(*counts)
""")
    after_build, after_second_release, after_failed_build, after_its_second_release = map(int, out)
    assert after_build == after_second_release
    assert after_failed_build == after_its_second_release
