"""pyproject.toml's package-data: a non-editable install must carry every file the C kernels
include, or the kernels fail to compile at first use and the engine falls back to slow paths."""
from __future__ import annotations

import fnmatch
import re
import tomllib

from launcher.local_stack import ROOT

CSRC = ROOT / "common" / "engine" / "csrc"


def package_data_globs() -> list[str]:
    """The package-data globs of ``common.engine``, relative to its directory."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    return list(data.get("common.engine", []))


def local_includes(path) -> set[str]:
    """The ``#include "..."`` names of one C source or header."""
    return set(re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), flags=re.MULTILINE))


def test_every_local_include_of_the_kernels_is_package_data():
    globs = package_data_globs()
    sources = sorted(CSRC.glob("*.c"))
    assert sources
    seen, todo = set(), [p.name for p in sources]
    while todo:  # the sources, then what they include, transitively
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = CSRC / name
        assert path.is_file(), f"{name} is included but not in {CSRC}"
        todo.extend(local_includes(path))
    missing = sorted(name for name in seen if not any(fnmatch.fnmatch(f"csrc/{name}", g) for g in globs))
    assert not missing, f"package-data for common.engine ({globs}) leaves out {missing}"
