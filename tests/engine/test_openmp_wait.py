"""The OpenMP wait setting: brief spinning, then sleep, unless the environment says otherwise."""
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
