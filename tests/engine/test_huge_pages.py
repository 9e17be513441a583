"""Large tensors on 2 MB pages (``common.engine.huge_pages``): a process configured to compute gets
transparent huge pages for a large tensor where the kernel hands them out on advice, and a value the
environment sets wins."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.engine import huge_pages

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    try:
        text = THP_MODE.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None


# A fresh interpreter: configured as a computing process (or not), then torch, then 64 MB written;
# prints how many kB of anonymous huge pages the tensor brought.
PROBE = """
import sys
def huge_kb():
    for line in open('/proc/self/smaps_rollup'):
        if line.startswith('AnonHugePages:'):
            return int(line.split()[1])
    return 0
if sys.argv[1] == 'configure':
    from common.engine import compute_process
    compute_process.configure()
import torch
before = huge_kb()
t = torch.empty(64 << 20, dtype=torch.uint8)
t.fill_(1)
print(huge_kb() - before)
"""


def _huge_kb_of_a_64mb_tensor(mode: str, env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, timeout=120,
                         check=True, cwd=Path(__file__).resolve().parents[2])
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="the kernel hands out no transparent huge pages")
def test_a_computing_process_puts_a_large_tensor_on_huge_pages():
    env = {k: v for k, v in os.environ.items() if k != huge_pages.VARIABLE}
    # a few 2 MB pages at least: the kernel may find memory too fragmented for all 32
    assert _huge_kb_of_a_64mb_tensor("configure", env) >= 8 << 10


@pytest.mark.skipif(_thp_mode() != "madvise", reason="only where huge pages come on advice alone")
def test_without_the_setting_a_large_tensor_stays_on_small_pages():
    # what the first test shows is the setting's doing, not the kernel's
    env = {k: v for k, v in os.environ.items() if k != huge_pages.VARIABLE}
    assert _huge_kb_of_a_64mb_tensor("plain", env) < 4 << 10
    assert _huge_kb_of_a_64mb_tensor("configure", {**env, huge_pages.VARIABLE: "0"}) < 4 << 10


def test_the_environment_wins(monkeypatch):
    monkeypatch.delenv(huge_pages.VARIABLE, raising=False)
    assert huge_pages.configure() and os.environ[huge_pages.VARIABLE] == "1"
    monkeypatch.setenv(huge_pages.VARIABLE, "0")
    assert not huge_pages.configure() and os.environ[huge_pages.VARIABLE] == "0"
