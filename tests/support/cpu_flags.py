"""This CPU's instruction-set flags as Linux reports them (tests that need a kernel's build skip
without its flags)."""
from __future__ import annotations


def cpu_has(*flags: str) -> bool:
    """Whether ``/proc/cpuinfo`` lists every one of ``flags`` (``False`` where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            present = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return all(flag in present for flag in flags)
