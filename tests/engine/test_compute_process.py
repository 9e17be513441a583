"""What a computing process sets first (``common.engine.compute_process``): it remembers the
environment its caller gave it, so a child that is not the engine -- the peer a benchmark compares
with -- runs under the caller's settings, not the engine's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A fresh interpreter configured twice (as an entry point and a module it imports both may), then
# printing the caller's environment, its own, and the environment the vLLM benchmark hands its peer.
PROBE = """
import json, os
from common.engine import compute_process
compute_process.configure()
compute_process.configure()
from benchmarks.vs_vllm_cpu import vllm_env
peer = vllm_env(2)
names = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "THP_MEM_ALLOC_ENABLE")
print(json.dumps({"caller": compute_process.caller_environment(),
                  "own": {name: os.environ.get(name) for name in names},
                  "peer": {name: peer.get(name) for name in names}}))
"""


def _probe(**overrides: str) -> dict:
    env = {name: value for name, value in os.environ.items()
           if name not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "THP_MEM_ALLOC_ENABLE")}
    env.update(overrides)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120,
                         check=True, cwd=ROOT)
    return json.loads(out.stdout.splitlines()[-1])


def test_the_engine_gets_its_settings_and_a_peer_the_callers():
    seen = _probe(OMP_WAIT_POLICY="ACTIVE")
    assert seen["own"] == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None, "THP_MEM_ALLOC_ENABLE": "1"}
    expected = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None, "THP_MEM_ALLOC_ENABLE": None}
    assert seen["caller"] == expected  # a second configure() does not take the first one's settings as the caller's
    assert seen["peer"] == expected


def test_a_caller_that_sets_nothing_leaves_the_peer_on_its_defaults():
    seen = _probe()
    assert seen["own"] == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "30000", "THP_MEM_ALLOC_ENABLE": "1"}
    assert seen["caller"] == seen["peer"] == dict.fromkeys(seen["own"])
